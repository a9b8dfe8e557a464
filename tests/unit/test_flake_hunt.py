"""scripts/flake_hunt.py: a failed or erroring test of a pass is listed with its failure; a passed one is not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("flake_hunt", REPO / "scripts" / "flake_hunt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_reports_failures_and_errors_are_listed_with_their_first_lines(tmp_path):
    report = tmp_path / "pass-1.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.integration.test_a" name="test_ok" time="1"/>'
        '<testcase classname="tests.integration.test_a" name="test_bad" time="2">'
        '<failure message="AssertionError: 3 != 4">long traceback</failure></testcase>'
        '<testcase classname="tests.unit.test_b" name="test_setup[x]" time="0">'
        '<error message="fixture failed">trace</error></testcase>'
        '<testcase classname="tests.unit.test_b" name="test_skipped" time="0"><skipped message="no GPU"/></testcase>'
        '</testsuite></testsuites>')
    assert _script().failures(report) == {"tests/integration/test_a.py::test_bad": "AssertionError: 3 != 4",
                                          "tests/unit/test_b.py::test_setup[x]": "fixture failed"}
