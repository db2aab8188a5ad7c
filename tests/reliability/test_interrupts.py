"""Ctrl-C outside the training loop: one line, exit 130, no traceback, nothing half-written.

A terminal's Ctrl-C signals the whole foreground process group, workers and ranks included: the
preprocessing run gets it that way here (SIGINT to its process group while it writes). The other commands
are interrupted in-process where their work starts (the interrupt raised there), which is what SIGINT
does to the main thread."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data.conftest import cli_flags

REPO = Path(__file__).resolve().parents[2]


def _interrupt(*_args, **_kwargs):
    raise KeyboardInterrupt


def _error_lines(text: str):
    return [ln for ln in text.strip().splitlines() if ln.strip()]


def _returns(fn, *args):
    """``fn(*args)``'s return value; an interrupt that escapes it is this test's failure, not the run's end."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        pytest.fail(f"{fn.__module__}.{fn.__name__}: the interrupt escaped (a traceback for the user)")


def test_preprocessing_ctrl_c_to_its_process_group_is_one_line(tok_args, tmp_path):
    docs = tmp_path / "docs.jsonl"
    line = {"text": "It is a truth universally acknowledged, that a single man in possession of a good fortune "
                    "must be in want of a wife. " * 4}
    with open(docs, "w") as f:
        for i in range(30_000):
            f.write(json.dumps(dict(line, id=i)) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(docs), "--output-prefix",
         str(out / "corpus"), "--workers", "2", "--no-progress-bar", "--batch-docs", "64",
         *cli_flags(tok_args["gpt2"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO), start_new_session=True)
    deadline = time.monotonic() + 120
    while not os.listdir(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the output is being written (its partial files exist)
    if proc.poll() is not None:
        pytest.fail(f"preprocessing ended before it could be interrupted (exit {proc.returncode}): give it more input")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the run and its two workers
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("preprocessing did not stop within 60 s of Ctrl-C")
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert [ln for ln in _error_lines(err) if ln.startswith("error")] == [f"error: interrupted (Ctrl-C); nothing was written to --output-prefix {out / 'corpus'} "
                                 "(its partial files were removed)"], err[-3000:]
    assert os.listdir(out) == []


def test_conversion_ctrl_c_is_one_line_and_removes_the_partial_output(tmp_path, capsys, monkeypatch):
    import megatron_lev.conversion as conversion
    from megatron_lev.conversion.source import ConversionInterrupted, disk_full_is_one_line
    from tools.convert_checkpoint import main as convert_main

    save = tmp_path / "hf"

    def half_written_export(src, out_dir, **_):
        with disk_full_is_one_line(str(out_dir), "the Hugging Face export"):
            os.makedirs(out_dir, exist_ok=True)
            (Path(out_dir) / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 64)
            raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "export_hf", half_written_export)
    assert _returns(convert_main, ["export-hf", "--load", str(tmp_path / "ck"), "--save", str(save)]) == 130
    err = _error_lines(capsys.readouterr().err)
    assert err == [f"error: --save {save}: interrupted (Ctrl-C) while writing the Hugging Face export; its partial "
                   "files were removed (1 written)"], err
    assert not save.exists()

    monkeypatch.setattr(conversion, "reshard_checkpoint", _interrupt)  # e.g. while reading the source
    assert _returns(convert_main, ["reshard", "--load", str(tmp_path / "ck"), "--save", str(save),
                                   "--target-tp", "1"]) == 130
    err = _error_lines(capsys.readouterr().err)
    assert err == [f"error: reshard: interrupted (Ctrl-C) before its output was written; nothing was written to "
                   f"--save {save}"], err

    # A nested write (import-hf's reshard into the folder it fills) removes the outer block's files too.
    outer = tmp_path / "import"
    with pytest.raises(ConversionInterrupted):
        with disk_full_is_one_line(str(outer), "the imported checkpoint"):
            (outer / ".import-tp1").mkdir(parents=True)
            with disk_full_is_one_line(str(outer), "the resharded checkpoint"):
                (outer / "iter_0000000").mkdir()
                raise KeyboardInterrupt
    assert not outer.exists() or os.listdir(outer) == []


def test_evaluation_ctrl_c_is_one_line(tmp_path, capsys, monkeypatch):
    from megatron_lev.evaluation import cli

    monkeypatch.setattr(cli, "check_inputs", _interrupt)  # the first step of an evaluation
    out = tmp_path / "eval"
    assert _returns(cli.main, ["--hf-model", str(tmp_path / "hf"), "--output-dir", str(out)]) == 130
    err = _error_lines(capsys.readouterr().err)
    assert err == [f"error: interrupted (Ctrl-C); --output-dir {out}: each file of this run there is whole or absent "
                   "(results.json and results.md are written at the end)"], err


def test_an_interrupted_result_file_is_not_left_half_written(tmp_path):
    from megatron_lev.evaluation.report import atomic_path, write_json

    path = tmp_path / "valid_per_token.npz"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(str(path)) as tmp:
            Path(tmp).write_bytes(b"PK\3\4 partial")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    write_json({"meta": {}}, str(tmp_path / "results.json"))
    assert os.listdir(tmp_path) == ["results.json"]
    assert json.loads((tmp_path / "results.json").read_text()) == {"meta": {}}


def test_training_ctrl_c_during_start_up_is_one_line(capsys, monkeypatch):
    from megatron_lev.training import loop
    from tests.training.test_arguments import BASE

    monkeypatch.setattr(loop, "_setup_configs", _interrupt)  # parsing, tokenizer, configs
    assert _returns(loop.pretrain, BASE) == 130
    err = _error_lines(capsys.readouterr().err)
    assert err == ["error: interrupted (Ctrl-C) during start-up, before the model was built; nothing was written"], err

    # Later in start-up (model build, checkpoint load, data): the last checkpoint is named.
    monkeypatch.undo()
    monkeypatch.setattr(loop, "init_distributed", lambda **_: None)
    monkeypatch.setattr(loop, "destroy_distributed", lambda setup: None)
    monkeypatch.setattr(loop, "rank_is0", lambda: True)
    monkeypatch.setattr(loop, "_start", _interrupt)
    assert _returns(loop.pretrain, BASE) == 130
    err = _error_lines(capsys.readouterr().err)
    assert err == ["error: interrupted (Ctrl-C) during start-up, before training started; no checkpoint was saved"], err
