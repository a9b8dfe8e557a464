"""Content digests of the code and files a run's config names: the same name must be the same content on every host.

A config names its rewards, rollout function, agent and environment by `module:function` (or `builtin:NAME`), and a
chat template by path. The run's digest (pipeline/runspec.py) covers those names only, so two hosts with different
`my_rewards.py` under one name would score the same samples differently and nobody would know. The learner computes
`content_digests` at start and serves them with the run's spec (RunSpec.contents); a generator computes its own
after it adopts the spec and refuses to serve a run whose content differs (`content_conflict`, naming the field); its
Register shows them and the hub checks them again. A checkpoint records them, and a resume on other content is
refused (learner/checkpoint.py): rewards are not RESUMABLE, and neither is what a reward's name stands for.

What is digested, per field (sha256 of the bytes, 32 hex characters, as the model's fingerprints):

    rewards[i].fn, generator.rollout, generator.agent, generator.environment
        `module:function`: the source file of the module, found as `import` would find it (importlib.util.find_spec,
        which runs no code of the module itself; a dotted name's parent packages are imported). Only that file: a
        helper module it imports is not pinned.
        `builtin:NAME`: the same, for the module of this project that defines it (pipeline/builtin.py). Not the
        project's version string: an edited checkout keeps its version, while the source of the function's module
        catches both another release and a local edit, and two releases whose function is the same still agree.
    generator.chat_template
        the template file's bytes. (data.chat_template is a switch for the tokenizer's own template, which the
        tokenizer's fingerprint covers.)
    generator.agent_command[i]
        a command's word that names a file on the host: a script given by path as the program (`./agent.sh`), or a
        file among its arguments (`python my_agent.py`); the word after `-m` as a module. A program found on PATH
        (`python`) is not digested: interpreters differ between hosts of one run without meaning anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from pipeline import builtin
from pipeline.config import Config, ConfigError


def content_digests(cfg: Config) -> dict[str, str]:
    """{dotted field: sha256} of the code and files `cfg` names, as found on this host. ConfigError, naming the field,
    where one is not found here: the learner pins what every generator must run, so it needs them too."""
    g = cfg.generator
    named = [(f"rewards[{i}].fn", r.fn) for i, r in enumerate(cfg.rewards)]
    named += [("generator.rollout", g.rollout), ("generator.agent", g.agent), ("generator.environment", g.environment)]
    out = {key: _module_digest(key, spec) for key, spec in named if spec}
    if g.chat_template:
        out["generator.chat_template"] = _file_digest("generator.chat_template", g.chat_template)
    for i, kind in command_files(g.agent_command).items():
        key, word = f"generator.agent_command[{i}]", g.agent_command[i]
        out[key] = _module_digest(key, word) if kind == "module" else _file_digest(key, word)
    return out


def command_files(command: list[str]) -> dict[int, str]:
    """The words of a command that name content on this host, {index: "file" or "module"}: the program where it is
    given by path, an argument that is a file, the word after `-m`. A file the learner's host has and a generator's
    lacks is refused there: the command would not run the same."""
    out = {}
    for i, word in enumerate(command):
        if i > 0 and command[i - 1] == "-m":
            out[i] = "module"
        elif (i > 0 or os.sep in word) and os.path.isfile(word):
            out[i] = "file"
    return out


def content_conflict(theirs: dict[str, str], ours: dict[str, str], cfg: Config,
                     here: str = "the generator's host", there: str = "the learner's", fix: str = "") -> str:
    """Why `theirs` (a generator's digests) is not the content `ours` pins ("" when it is): the first field that
    differs, named with what it names in `cfg`, both digests and `fix` (default: deploy the same on both hosts). A
    field `ours` leaves out is not pinned."""
    for key in ours:
        if theirs.get(key) != ours[key]:
            seen = f"sha256 {theirs[key]:.12}" if key in theirs else "nothing"
            return (f"{key} ({_named(cfg, key)}): {_what(cfg, key)} differs between {here} ({seen}) and {there} "
                    f"(sha256 {ours[key]:.12}): {fix or _fix(cfg, key)}")
    return ""


def _module_digest(key: str, spec: str) -> str:
    module = builtin.module_path(spec).partition(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except Exception as e:  # a parent package that does not import here, whatever it raises
        raise ConfigError(f"{key}: cannot find module {module!r} of {spec!r} on this host ({e})") from None
    if found is None:
        raise ConfigError(f"{key}: no module {module!r} ({spec!r}) on this host: the learner pins the source every "
                          "generator runs, so it must be where each of them imports from (working directory, "
                          "PYTHONPATH)")
    if not found.has_location or not found.origin or not os.path.isfile(found.origin):
        return _sha(f"{module}: no source file ({found.origin})".encode())  # built into Python, a namespace package
    return _sha(Path(found.origin).read_bytes())


def _file_digest(key: str, path: str) -> str:
    try:
        return _sha(Path(path).read_bytes())
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path!r} on this host ({e.strerror})") from None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _named(cfg: Config, key: str) -> str:
    """What field `key` says in `cfg`: `my_rewards:score`, `tools.jinja`, a command's word."""
    if key.startswith("rewards["):
        return cfg.rewards[_index(key)].fn
    if key.startswith("generator.agent_command["):
        return cfg.generator.agent_command[_index(key)]
    return str(getattr(cfg.generator, key.split(".", 1)[1]))


def _what(cfg: Config, key: str) -> str:
    named, i = _named(cfg, key), _index(key)
    if key == "generator.chat_template" or (key.startswith("generator.agent_command[")
                                            and (i == 0 or cfg.generator.agent_command[i - 1] != "-m")):
        return f"the file {named}"
    return f"the source of module {builtin.module_path(named).partition(':')[0]}"


def _fix(cfg: Config, key: str) -> str:
    named = _named(cfg, key)
    if named.startswith("builtin:"):
        return "a checkout of this project whose builtin functions differ: run the same release, unedited, on both"
    return "deploy the same file on both hosts"


def _index(key: str) -> int:
    """The list index in a field's key (`rewards[2].fn`: 2), -1 where it has none."""
    return int(key[key.index("[") + 1:key.index("]")]) if "[" in key else -1
