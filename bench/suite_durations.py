"""Where the test suite's time goes: per module and per test, from pytest's JUnit XML.

    python -m pytest --junitxml=suite.xml ...
    python bench/suite_durations.py suite.xml [other.xml] [--top 40] [--modules 25]

Prints, as Markdown, the modules by their total time (tests, share of the run) and the slowest tests.
A test's time in the XML is its setup, call and teardown together, so a module fixture (one torchrun
job shared by a module's tests) is charged to the first test that uses it; the module total is the
figure to compare. With two files (e.g. the two stacks of `.ci/run`) the modules are listed side by
side. Reports on the run it is given: wall time, machine load and concurrency are the caller's to state.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, NamedTuple


class Case(NamedTuple):
    module: str  # tests/training/test_pretrain.py
    name: str  # test id inside the module
    seconds: float
    outcome: str  # passed, failed, error, skipped


def read_junit(path: str) -> List[Case]:
    """The test cases of one pytest JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise SystemExit(f"error: {path}: not a readable JUnit XML file ({e}); write one with pytest --junitxml=PATH")
    cases = []
    for tc in root.iter("testcase"):
        classname = tc.get("classname", "")
        # pytest writes "tests.training.test_pretrain" (plus ".Class" for tests in a class).
        parts = classname.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        module = "/".join(parts) + ".py" if parts else classname
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if tc.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        cases.append(Case(module, tc.get("name", ""), float(tc.get("time", 0.0)), outcome))
    return cases


def module_totals(cases: List[Case]) -> Dict[str, tuple]:
    """module -> (seconds, number of tests), slowest first."""
    acc: Dict[str, list] = defaultdict(lambda: [0.0, 0])
    for c in cases:
        acc[c.module][0] += c.seconds
        acc[c.module][1] += 1
    return dict(sorted(((m, tuple(v)) for m, v in acc.items()), key=lambda kv: -kv[1][0]))


def report(paths: List[str], top: int = 40, modules: int = 25) -> str:
    runs = [read_junit(p) for p in paths]
    totals = [module_totals(r) for r in runs]
    out = []
    heads = " | ".join(f"{Path(p).name} s | share | tests" for p in paths)
    out += [f"| module | {heads} |", "|---|" + "---:|" * (3 * len(paths))]
    # Every file's modules (test-next runs the fake-CUDA ones make test deselects), slowest anywhere first.
    names = sorted(set().union(*totals), key=lambda m: -max(t.get(m, (0.0, 0))[0] for t in totals))
    for m in names[:modules]:
        cells = []
        for run, tot in zip(runs, totals):
            s, n = tot.get(m, (0.0, 0))
            whole = sum(c.seconds for c in run) or 1.0
            cells.append(f"{s:.1f} | {100 * s / whole:.1f}% | {n}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    for p, run in zip(paths, runs):
        whole = sum(c.seconds for c in run)
        counts = defaultdict(int)
        for c in run:
            counts[c.outcome] += 1
        out += ["", f"{p}: {len(run)} tests ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), "
                f"{whole:.0f} s in tests" + (f"; slowest {min(top, len(run))}:" if top > 0 else "")]
        if top > 0:
            out += ["", "| s | test |", "|---:|---|"]
            out += [f"| {c.seconds:.1f} | {c.module}::{c.name} |" for c in sorted(run, key=lambda c: -c.seconds)[:top]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", nargs="+", help="pytest --junitxml files (one per stack or run)")
    ap.add_argument("--top", type=int, default=40, help="slowest tests listed per file (default 40)")
    ap.add_argument("--modules", type=int, default=25, help="modules listed (default 25)")
    a = ap.parse_args(argv)
    print(report(a.junit, a.top, a.modules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
