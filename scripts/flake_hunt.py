"""Run tests N times and list every test that failed at least once, with its failure: a flake hunt anyone can run.

    python scripts/flake_hunt.py N [PYTEST ARGS...]        # default: the integration tests (-m integration)

Each pass is `python -m pytest` with a JUnit XML report in a folder of its own (kept: --keep DIR, else a temporary
one); the listing reads those reports. Exit status: 0 when every pass was green, 1 otherwise."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def failures(report: Path) -> dict[str, str]:
    """{test id: the first lines of its failure or error} of one JUnit XML report."""
    out = {}
    for case in ET.parse(report).iter("testcase"):
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                text = (bad.get("message") or bad.text or kind).strip().splitlines()
                out[test] = "\n".join(text[:6])
    return out


def hunt(passes: int, args: list[str], folder: Path) -> int:
    failed: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for n in range(1, passes + 1):
        report = folder / f"pass-{n}.xml"
        start = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                              *args], cwd=REPO)
        minutes = (time.monotonic() - start) / 60
        found = failures(report) if report.exists() else {"(no report)": f"pytest exited {rc}"}
        print(f"pass {n}/{passes}: exit {rc}, {minutes:.1f} min, {len(found)} failed", flush=True)
        for test, why in found.items():
            failed[test].append((n, why))
    print(f"\n{len(failed)} test(s) failed at least once in {passes} pass(es); reports in {folder}")
    for test, seen in sorted(failed.items()):
        print(f"\n{test}: failed in pass(es) {', '.join(str(n) for n, _ in seen)}")
        for line in seen[0][1].splitlines():
            print(f"    {line}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("passes", type=int)
    parser.add_argument("--keep", type=Path, help="keep the JUnit reports in this folder")
    parsed, rest = parser.parse_known_args()
    args = rest or ["-m", "integration"]
    if parsed.keep:
        parsed.keep.mkdir(parents=True, exist_ok=True)
        return hunt(parsed.passes, args, parsed.keep)
    with tempfile.TemporaryDirectory(prefix="flake-hunt-") as folder:
        return hunt(parsed.passes, args, Path(folder))


if __name__ == "__main__":
    sys.exit(main())
