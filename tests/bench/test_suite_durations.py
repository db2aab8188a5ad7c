"""bench/suite_durations.py, the suite-cost report .ci/run prints: tests are grouped by module (tests in
a class too), module totals and the slowest tests come out in order, outcomes are counted, and a file
that is not JUnit XML is one line naming it."""

from __future__ import annotations

import pytest

from tests.bench import load_bench

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.training.test_pretrain" name="test_a" time="50.5" />
<testcase classname="tests.training.test_pretrain" name="test_b" time="1.5"><skipped message="x"/></testcase>
<testcase classname="tests.models.test_gpt.TestShapes" name="test_c[tied]" time="30.0" />
<testcase classname="tests.models.test_gpt" name="test_d" time="25.0"><failure message="boom"/></testcase>
</testsuite></testsuites>"""


def test_modules_tests_and_outcomes(tmp_path):
    sd = load_bench("suite_durations")
    path = tmp_path / "a.xml"
    path.write_text(XML)
    cases = sd.read_junit(str(path))
    assert [c.module for c in cases] == ["tests/training/test_pretrain.py"] * 2 + ["tests/models/test_gpt.py"] * 2
    assert [c.outcome for c in cases] == ["passed", "skipped", "passed", "failed"]
    assert sd.module_totals(cases) == {"tests/models/test_gpt.py": (55.0, 2), "tests/training/test_pretrain.py": (52.0, 2)}
    text = sd.report([str(path), str(path)], top=2)
    rows = text.splitlines()
    assert rows[2] == "| tests/models/test_gpt.py | 55.0 | 51.4% | 2 | 55.0 | 51.4% | 2 |"
    assert "4 tests (1 failed, 2 passed, 1 skipped), 107 s in tests; slowest 2:" in text
    slow = [r for r in rows if r.startswith("| 50.5 |") or r.startswith("| 30.0 |")]
    assert slow[:2] == ["| 50.5 | tests/training/test_pretrain.py::test_a |",
                        "| 30.0 | tests/models/test_gpt.py::test_c[tied] |"]
    assert "::test_d" not in text  # 25 s is the third slowest: not listed
    # A module only the second file has (fake-CUDA tests run on one stack only) is listed, 0 for the first.
    other = tmp_path / "b.xml"
    other.write_text(XML.replace("tests.models.test_gpt.TestShapes", "tests.models.test_fake_cuda"))
    rows = sd.report([str(path), str(other)], top=0).splitlines()
    assert "| tests/models/test_fake_cuda.py | 0.0 | 0.0% | 0 | 30.0 | 28.0% | 1 |" in rows


def test_a_file_that_is_not_junit_is_one_line(tmp_path):
    sd = load_bench("suite_durations")
    bad = tmp_path / "log.txt"
    bad.write_text("637 passed in 2141s")
    with pytest.raises(SystemExit) as e:
        sd.read_junit(str(bad))
    assert str(e.value).startswith(f"error: {bad}: not a readable JUnit XML file") and "\n" not in str(e.value)
