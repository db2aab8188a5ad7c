"""Plumbing of bench/dense_to_lev.py without training: the commands of each step (dry run) and the
report generated from fake fit, evaluation and metrics files."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench import load_bench

REPO = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench("dense_to_lev")


def test_dry_run_lists_every_step(tmp_path, capsys):
    b = _bench()
    data = tmp_path / "data"
    assert b.main(["--work-dir", str(tmp_path / "w"), "--data-dir", str(data), "--dry-run",
                   "--pretrain-iters", "6", "--continue-iters", "4"]) == 0
    cmds = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  $ ")]
    text = "\n".join(cmds)
    assert len(cmds) == 8  # pretrain, to-lev, 2 evaluations, 2 x (continue + evaluation)
    assert "--input-embedding tied" in cmds[0] and "--train-iters 6" in cmds[0]
    assert "to-lev" in cmds[1] and f"--token-counts {data / 'gpt2_train_text_token_counts.npy'}" in cmds[1]
    assert text.count("--no-load-optim") == 2 and text.count("--train-iters 10") == 2
    assert "iter_0000006/config.yaml" in cmds[4] and "--lr-decay-style constant" in cmds[4]


def test_report_from_fake_files(tmp_path):
    b = _bench()
    w = tmp_path / "w"
    buckets = [{"bucket": "< 1e-7", "vocab_ids": 10, "relative_error": 0.5},
               {"bucket": "≥ 1e-4", "vocab_ids": 90, "relative_error": 0.1}]
    w.mkdir()
    (w / "fit.json").write_text(json.dumps({
        "relative_error": 0.2, "weighted_relative_error": 0.12, "initial_relative_error": 1.3, "buckets": buckets,
        "lev_params": 1000, "table_params": 100000, "steps": 300, "seconds": 12.0, "stopped_because": "max_steps"}))
    ppl = {"dense": 100.0, "lev": 150.0, "dense_cont": 90.0, "lev_cont": 99.0}
    for name, v in ppl.items():
        d = w / "eval" / name
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"perplexity": {"valid": {"ppl": v, "frequency_buckets": [
            {"bucket": "< 1e-7", "ppl": v * 3}, {"bucket": "≥ 1e-4", "ppl": v / 2}]}}}))
    for name, losses in (("dense", [4.6, 4.5]), ("lev", [5.0, 4.6])):
        (w / f"continue_{name}_metrics.jsonl").write_text("".join(
            json.dumps({"kind": "valid", "iteration": 10 * (i + 1), "lm loss": x}) + "\n"
            for i, x in enumerate(losses)))
    a = b.parse_args(["--work-dir", str(w), "--pretrain-iters", "100", "--continue-iters", "20"])
    text = b.build_report(a, "python bench/dense_to_lev.py")
    assert "+50.0% validation PPL (100.00 -> 150.00)" in text
    assert "+10.0% relative to the dense model's" in text
    assert "| converted to LEV, iteration 100 (step 0) | 150.00 | 450.00 | 75.00 |" in text
    assert "| 20 | 4.500 | 4.600 |" in text and "| < 1e-7 | 10 | 0.5000 |" in text
    assert "1.00%" in text and "python bench/dense_to_lev.py" in text
