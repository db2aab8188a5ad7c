"""megatron_lev.progress: a tqdm bar on a terminal, otherwise plain lines every N items or seconds."""

from __future__ import annotations

import io

import pytest

from megatron_lev.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_every_n_items_without_a_terminal():
    out = io.StringIO()
    with Progress("docs", unit="doc", every=3, line=lambda done, s: f"processed {done}", stream=out) as p:
        for _ in range(5):
            p.update(2)  # 2, 4, 6, 8, 10: past 3, 6 and 9
    assert out.getvalue().splitlines() == ["processed 4", "processed 6", "processed 10"]


def test_lines_every_n_seconds_name_the_work_and_its_count():
    out = io.StringIO()
    p = Progress("hellaswag", total=16, unit="request", seconds=0, stream=out)  # 0: every update
    p.update(4)
    p.update(12)
    lines = out.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["hellaswag: 4/16 requests", "hellaswag: 16/16 requests"]
    out = io.StringIO()
    p = Progress("valid", unit="window", seconds=3600, stream=out)
    p.update(8)
    assert out.getvalue() == ""  # not yet due
    p.t0 = p.last_line = p.last_line - 3600
    p.update(8)
    assert out.getvalue().startswith("valid: 16 windows (")


def test_a_bar_on_a_terminal_and_nothing_when_disabled():
    term = Terminal()
    with Progress("valid", unit="window", seconds=0, stream=term) as p:
        p.update(3)
        assert p.bar is not None
    assert "valid" in term.getvalue() and "\r" in term.getvalue()  # tqdm's, no plain line
    assert "windows (" not in term.getvalue()
    quiet = Terminal()
    with Progress("valid", seconds=0, enabled=False, stream=quiet) as p:
        p.update(3)
    assert quiet.getvalue() == "" and p.done == 3


@pytest.mark.parametrize("argv, message", [
    (["--progress-interval", "-1"], "argument --progress-interval: '-1' is not a number of seconds >= 0"),
    (["--progress-interval", "soon"], "argument --progress-interval: 'soon' is not a number of seconds >= 0"),
    (["--progress-interval", "5", "--no-progress"],
     "--progress-interval sets the progress lines that --no-progress turns off; give one of them"),
])
def test_evaluation_progress_flags_are_refused_in_one_line_before_any_work(argv, message, tmp_path, capsys):
    from megatron_lev.evaluation.cli import main

    assert main(["--load", str(tmp_path / "none"), "--output-dir", str(tmp_path / "out")] + argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "out").exists()
