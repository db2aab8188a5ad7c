"""``make demo`` (examples/quickstart_cpu.sh) trains, evaluates, compares and summarises the untied, lev and
tied arms, the same model but for ``--input-embedding``, with untied (LEV's output head) the reference; a
rerun does nothing again.

The script runs whole with a stand-in for its Python (``PYTHON``): the tools' calls are recorded and
answered with the files and log lines the script reads, while its own inline Python (``python -``) runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARMS = ["untied", "lev", "tied"]

STAND_IN = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path

argv = sys.argv[1:]
if argv[:1] == ["-"]:  # the script's own inline Python
    os.execv({sys.executable!r}, [{sys.executable!r}] + argv)
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps(argv) + "\\n")


def value(flag):
    return argv[argv.index(flag) + 1]


if "pretrain_lev.py" in argv:
    iters, ckpt, metrics = value("--train-iters"), Path(value("--save")), Path(value("--metrics-file"))
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(iters)
    metrics.write_text(json.dumps({{"kind": "train", "iteration": int(iters), "lm loss": 6.0}}) + "\\n"
                       + json.dumps({{"kind": "valid", "iteration": int(iters), "lm loss": 6.1, "ppl": 445.9}}) + "\\n")
    print("  input side   1,000")
    print("  total   9,000")
    print(" [t] iteration 10/10 | elapsed time per iteration (ms): 50.0 | tokens per second: 900.0 |")
    print(f"validation loss at iteration {{iters}} on validation set")
elif "--compare" in argv:
    print("comparison")
elif "tools/evaluate.py" in argv:
    print("a rank's start-up notice", file=sys.stderr, flush=True)
    if "--no-progress" not in argv:  # as evaluate.py prints its progress when standard error is not a terminal
        print("evaluating 1/1: valid (perplexity of x)", file=sys.stderr, flush=True)
        print("valid: 64 windows (3.2 windows/s, 20 s)", file=sys.stderr, flush=True)
    print("valid: 9000 tokens, NLL 6.1000, PPL 445.900")
    out = Path(value("--output-dir"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text("{{}}")
"""


def _run(tmp_path: Path, calls: Path, **knobs: str) -> subprocess.CompletedProcess:
    data, tok = tmp_path / "data", tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        (tok / name).write_text("")
    data.mkdir(exist_ok=True)
    for split in ("train", "valid"):  # preprocessed already: the script skips the step
        for suffix in ("_text_document.idx", "_text_document.bin", "_text_token_counts.npy"):
            (data / f"gpt2_{split}{suffix}").write_text("")
    env = {**os.environ, "PYTHON": str(tmp_path / "python"), "CALLS": str(calls), "OUT": str(tmp_path / "out"),
           "DATA": str(data), "SHARED_TOKENIZER": str(tok), "TRAIN_ITERS": "10", **knobs}
    return subprocess.run(["bash", str(REPO / "examples/quickstart_cpu.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def _calls(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quickstart")
    stand_in = tmp / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    first = _run(tmp, tmp / "calls.jsonl")
    again = _run(tmp, tmp / "calls_again.jsonl")
    return first, _calls(tmp / "calls.jsonl"), again, _calls(tmp / "calls_again.jsonl")


def _arm(call):
    return call[call.index("--input-embedding") + 1]


def test_the_demo_trains_evaluates_and_compares_the_three_arms(demo):
    first, calls, _, _ = demo
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    trained = [c for c in calls if "pretrain_lev.py" in c]
    assert [_arm(c) for c in trained] == ARMS
    # The same run but for the input embedding (and where it writes).
    own = {"--input-embedding", "--save", "--load", "--tensorboard-dir", "--metrics-file"}

    def shared(call):
        return [a for i, a in enumerate(call) if a not in own and (i == 0 or call[i - 1] not in own)]

    assert all(shared(c) == shared(trained[0]) for c in trained)
    evaluations = [c for c in calls if "tools/evaluate.py" in c and "--load" in c]
    assert [c[c.index("--label") + 1] for c in evaluations] == ARMS
    assert not [c for c in evaluations if "--max-tokens" in c]  # every validation token by default
    (compare,) = [c for c in calls if "--compare" in c]
    files = compare[compare.index("--compare") + 1:compare.index("--labels")]
    labels = compare[compare.index("--labels") + 1:compare.index("--output-dir")]
    assert labels == ARMS and [Path(f).parent.parent.name for f in files] == ARMS


def test_the_evaluations_show_their_progress(demo):
    first = demo[0]
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    for arm in ARMS:
        shown = first.stdout.split(f"{arm}: evaluating (")[1].splitlines()[1:4]
        assert shown == ["evaluating 1/1: valid (perplexity of x)", "valid: 64 windows (3.2 windows/s, 20 s)",
                         "valid: 9000 tokens, NLL 6.1000, PPL 445.900"], (arm, first.stdout[-3000:])
    assert "start-up notice" not in first.stdout  # the rest stays in eval.log


def test_the_summary_has_a_row_per_arm(demo):
    first = demo[0]
    summary = first.stdout.split("training summary")[1].splitlines()
    rows = [line.split() for line in summary if line.split()[:1] and line.split()[0] in ARMS]
    assert [r[0] for r in rows] == ARMS, first.stdout[-2000:]
    assert all(r[1:3] == ["6.1000", "445.90"] and r[3:5] == ["1,000", "9,000"] for r in rows), rows


def test_a_rerun_trains_and_evaluates_nothing_again(demo):
    _, _, again, calls = demo
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert not [c for c in calls if "pretrain_lev.py" in c or "--load" in c], calls
    assert all(f"{arm}: finished earlier" in again.stdout and f"{arm}: evaluated earlier" in again.stdout
               for arm in ARMS)
    assert [c for c in calls if "--compare" in c]  # the comparison is printed again


def test_eval_tokens_limits_each_evaluation(tmp_path):
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    r = _run(tmp_path, tmp_path / "calls.jsonl", EVAL_TOKENS="20000")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    evaluations = [c for c in _calls(tmp_path / "calls.jsonl") if "tools/evaluate.py" in c and "--load" in c]
    assert [c[c.index("--max-tokens") + 1] for c in evaluations] == ["20000"] * len(ARMS)
