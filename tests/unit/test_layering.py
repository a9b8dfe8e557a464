"""The import graph of the packages (every import, a function's late ones too): no cycle, and no package importing
one above it. From the top: the entry points (pipeline.entrypoints, and `python -m pipeline`), the learner
(the trainer), the hub and the generator (beside each other: neither imports the other), the weights transports,
and the rest of pipeline (config, protocol, host, ...), which every package may use."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"entrypoints": 4, "learner": 3, "hub": 2, "generator": 2, "weights": 1, "pipeline": 0}


def package(module: str) -> str:
    """The layer a module is in: pipeline.entrypoints and pipeline.__main__ are the entry points."""
    if module.startswith("pipeline.entrypoints") or module == "pipeline.__main__":
        return "entrypoints"
    return module.split(".")[0]


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for top in ("pipeline", "learner", "hub", "generator", "weights"):
        for path in (root / top).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the project's modules it imports}; `from a import b` is module a.b where that is one, else a."""
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                          for a in node.names}
        edges[name] = {m for m in found if m in known and m != name}
    return edges


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports of a package above the importer's, or beside it (hub and generator)."""
    bad = []
    for source, targets in edges.items():
        for target in targets:
            a, b = package(source), package(target)
            if a != b and LAYERS[b] >= LAYERS[a]:
                bad.append(f"{source} imports {target} ({b} is not below {a})")
    return sorted(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_package_imports_one_above_it_and_no_module_imports_itself_back():
    edges = graph(modules())
    assert len(edges) > 80 and "hub.hub" in edges["learner.service"]  # the walk sees the code
    assert upward(edges) == []
    assert cycles(edges) == []


def test_only_the_entry_point_imports_the_generators_coordinator():
    """generator/service.py wires its parts (session.py, leases.py, weights_loop.py) and hands each what it uses: no
    part imports it back, and neither does anything else but `pipeline generator`."""
    edges = graph(modules())
    assert {"generator.session", "generator.leases", "generator.weights_loop"} <= edges["generator.service"]
    assert sorted(m for m, targets in edges.items() if "generator.service" in targets) == [
        "pipeline.entrypoints.generator"]


def test_the_walk_finds_an_upward_import_and_a_cycle(tmp_path):
    """The checks themselves: a weights module that imports the hub, and two pipeline modules that import each
    other (as pipeline/launcher.py and weights/files.py did before pipeline/host.py)."""
    for top in ("pipeline", "learner", "hub", "generator", "weights"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "hub" / "hub.py").write_text("from pipeline import config\n")
    (tmp_path / "weights" / "files.py").write_text("def f():\n    from hub.hub import Hub\n")
    (tmp_path / "pipeline" / "config.py").write_text("from pipeline.launcher import processes\n")
    (tmp_path / "pipeline" / "launcher.py").write_text("def f():\n    from pipeline import config\n")
    edges = graph(modules(tmp_path))
    assert upward(edges) == ["weights.files imports hub.hub (hub is not below weights)"]
    assert cycles(edges) == [["pipeline.config", "pipeline.launcher"]]


def test_the_hub_imports_no_torch():
    """The hub is the run's message queue: importing it (with everything it imports) leaves torch out."""
    import subprocess

    code = "import sys, hub.hub, hub.serving; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stderr
