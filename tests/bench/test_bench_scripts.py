"""Plumbing of bench/reproduce.py and bench/throughput.py without training: argument handling,
the commands each run gets, and the reports generated from fake run and result files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.bench import load_bench

REPO = Path(__file__).resolve().parents[2]


_load = load_bench


@pytest.fixture(scope="module")
def rep():
    return _load("reproduce")


@pytest.fixture(scope="module")
def tp():
    return _load("throughput")


def test_runs_and_outputs(rep, tmp_path):
    a = rep.parse_args(["--quick", "--work-dir", str(tmp_path)])
    names = [r["name"] for r in rep.runs_of(a)]
    arms = ["tied", "untied", "albert", "flat_mlp", "factored_mlp", "lev"]
    assert names == [f"{x}_s{s}" for s in (1234, 1235) for x in arms]  # every arm with every seed
    narrowed = rep.parse_args(["--quick", "--work-dir", str(tmp_path), "--multi-seed-arms", "tied,lev"])
    assert [r["name"] for r in rep.runs_of(narrowed)][len(arms):] == ["tied_s1235", "lev_s1235"]
    assert a.output.name == "micro_reproduction_quick.md"
    assert rep.parse_args([]).output.name == "micro_reproduction.md"
    with pytest.raises(SystemExit):
        rep.parse_args(["--arms", "tied,bogus"])
    with pytest.raises(SystemExit):
        rep.parse_args(["--seeds", "x"])


def test_arms_share_every_flag_but_the_input_embedding(rep, tmp_path):
    a = rep.parse_args(["--work-dir", str(tmp_path)])
    runs = [r for r in rep.runs_of(a) if r["seed"] == 1234]
    cmds, caches = [], set()
    for r in runs:
        c = rep.train_command(a, r)
        caches.add(c[c.index("--data-cache-path") + 1])  # side-by-side runs must not share index files
        i = c.index("--input-embedding")
        assert c[i + 1] == r["arm"]
        c = [x.replace(r["name"], "RUN") for x in c[:i] + c[i + 2:]]
        cmds.append(c)
    assert all(c == cmds[0] for c in cmds)
    assert len(caches) == len(runs)
    ev = rep.eval_command(a, runs[0])
    for flag in ("--token-counts", "--zeroshot-data", "--tasks", "--limit", "--max-tokens"):
        assert flag in ev
    # The science configurations score whole sets (GPU) or documents spread over them (CPU), never their head.
    for config, flag in (("gpu-science", None), ("cpu-study", "--sample-tokens")):
        b = rep.parse_args(["--config", config, "--work-dir", str(tmp_path)])
        ev = rep.eval_command(b, rep.runs_of(b)[0])
        assert "--max-tokens" not in ev and (flag is None or flag in ev), (config, ev)


def _fake_results(ppl: float, rare: float, label: str):
    buckets = [{"bucket": b, "lo": 0.0, "hi": None, "tokens": n, "vocab_ids": 5, "nll": None, "ppl": p}
               for b, n, p in (("<1e-05", 100, rare), ("1e-05..1e-04", 500, ppl), (">=1e-04", 2000, ppl * 0.8))]
    per = {"tokens": 2600, "ppl": ppl, "nll": 1.0, "frequency_buckets": buckets}
    return {"meta": {"label": label, "iteration": 20}, "perplexity": {"valid": per, "zeroshot": dict(per, ppl=ppl * 2)},
            "tasks": {"lambada": {"examples": 8, "acc": 0.1, "ppl": 900.0},
                      "piqa": {"examples": 8, "acc": 0.5, "acc_norm": 0.55}}}


def test_report_from_fake_runs(rep, tmp_path):
    a = rep.parse_args(["--quick", "--work-dir", str(tmp_path / "w"), "--output", str(tmp_path / "out" / "r.md")])
    vals = {"tied": (100.0, 1000.0), "untied": (98.0, 900.0), "albert": (110.0, 1200.0), "flat_mlp": (105.0, 1100.0),
            "factored_mlp": (102.0, 950.0), "lev": (95.0, 700.0)}
    # Per-document NLL sums: lev 0.1 nats per token below tied in every document and seed; untied - tied
    # changes sign between the seeds (+0.05, -0.05 nats), so its interval contains 0.
    tokens = np.array([50, 80, 120, 60, 90])
    shift = {"tied": lambda s: 0.0, "lev": lambda s: -0.1 - 0.01 * (s - 1234), "untied": lambda s: 0.05 * (1 if s == 1234 else -1),
             "albert": lambda s: 0.2, "flat_mlp": lambda s: 0.1, "factored_mlp": lambda s: 0.05}
    counts_path = rep.data_paths(a)["counts"]
    counts_path.parent.mkdir(parents=True)
    np.save(counts_path, np.arange(256) * 1000)
    for r in rep.runs_of(a):
        d = a.work_dir / r["name"]
        (d / "eval").mkdir(parents=True)
        ppl, rare = vals[r["arm"]]
        ppl += r["seed"] - 1234
        (d / "eval" / "results.json").write_text(json.dumps(_fake_results(ppl, rare, r["name"])))
        per_token = 5.0 + shift[r["arm"]](r["seed"])
        for name in ("valid", "zeroshot"):
            np.savez(d / "eval" / f"{name}_per_token.npz", nll_by_id=np.full(256, per_token * 2), count_by_id=np.full(256, 2),
                     nll_by_doc=tokens * (per_token + 0.01 * np.arange(5)), tokens_by_doc=tokens)
        with open(d / "metrics.jsonl", "w") as f:
            for it in range(1, 21):
                f.write(json.dumps({"kind": "train", "iteration": it, "lm loss": 10.0 - it * 0.1 + shift[r["arm"]](r["seed"]),
                                    "grad norm": 2.0 if it < 5 else 0.5, "clipped": it < 5,
                                    **({"grad norm input": 1.0, "grad norm body": 0.5, "grad norm head": 0.2}
                                       if it % 5 == 0 else {})}) + "\n")
            f.write(json.dumps({"kind": "valid", "iteration": 20, "lm loss": 8.0}) + "\n")
        (d / "train.log").write_text(" iteration 5/ 20 | elapsed time per iteration (ms): 120.0 | tokens per second: 4000.0 |\n")
    text = rep.build_report(a, rep.collect(a), a.output, "python bench/reproduce.py --quick", {"load_start": [1, 1, 1]})
    assert "QUICK RUN" in text
    for section in ("## Parameters of each arm", "## Final metrics", "### Seed spread", "## Loss curves",
                    "## Perplexity by training frequency", "## Ablation ladder", "## Seed-paired differences",
                    "### What the intervals support", "### validation: mean NLL by exposure",
                    "## Gradient norms and clipping", "## Learning-curve gap"):
        assert section in text, section
    assert "- validation, lev - tied over 2 seeds: -0.1050 [" in text
    assert "lev is better than tied (both intervals below 0)" in text
    assert "untied - tied over 2 seeds: +0.0000 [" in text and "no difference shown (an interval contains 0)" in text
    assert "agrees with the paper" not in text and "beats" not in text  # no judgement from single runs
    assert "| lev | 1.000 | 0.500 | 0.200 | 1.000 | 0.500 | 0.200 | 0.800 | 0.20 |" in text  # global: (4 x 2 + 16 x 0.5) / 20
    fig = a.output.parent / a.output.stem
    assert (fig / "loss_curves.png").stat().st_size > 0
    assert (fig / "compare_valid.png").stat().st_size > 0


def test_throughput_arms_and_report(tp, tmp_path):
    arms = tp.arm_list("cpu")
    names = [x["name"] for x in arms]
    assert names[:2] == ["tied", "untied"] and len(names) == 8
    assert [x["name"] for x in arms if x.get("default")] == ["lev unique/fused"]

    def arm(name, a, ms, best=None, **kw):
        return {"arm": a, "ms_per_iter": ms, "ms_min": best or ms, "ms_max": ms, "tokens_per_s": 2048 / ms * 1e3,
                "input_layer_ms": 1.0, "input_layer_share": 1.0 / ms, "peak_step_mib": 10.0, "parameters": 1,
                "input_side_parameters": 1, "vs_tied": ms / 100.0, **kw}

    res = {"shape": tp.CONFIGS["cpu"], "device": "cpu", "dtype": "float32", "fp8": None, "ids": "x",
           "unique_ids": 5, "tokens_per_step": 2048, "repeats": 3, "load_start": [1, 1, 1], "load_end": [1, 1, 1],
           "arms": {"tied": arm("tied", "tied", 100.0), "untied": arm("untied", "untied", 110.0),
                    "lev unique/dense": arm("", "lev", 104.0, mode="unique", basis="dense"),
                    "lev unique/fused": arm("", "lev", 103.0, 95.0, mode="unique", basis="fused", default=True)},
           "lev_default": "lev unique/fused", "lev_fastest": "lev unique/fused"}
    results = {"command": "python bench/throughput.py", "created": "now", "machine": {"cpu": "c", "cpus": 2, "threads": 2,
               "gpu": None, "platform": "p"}, "versions": {"torch": "t"}, "load_start": [9, 9, 9], "load_end": [9, 9, 9],
               "sections": [{"title": "CPU", "target": 1.05, "result": res}], "gpu_ran": False,
               "preprocess": {"command": "python bench/preprocess.py", "returncode": 0, "output": "tok/s table",
                              "load_start": [1], "load_end": [1], "seconds": 1.0}}
    out = tmp_path / "t.md"
    tp.write_report(out, results)
    text = out.read_text()
    # The headline is on median steps (a quiet best step of one arm must not decide it), against both arms.
    assert "LEV/TIED = 1.030, LEV/UNTIED = 0.936" in text and "met" in text
    assert "On best steps: LEV/TIED = 0.950" in text
    assert "process CPU time" not in text
    res["clock"] = "cpu"  # --clock cpu says so in the section
    tp.write_report(out, results)
    assert "timed in process CPU time (--clock cpu)" in out.read_text()
    assert "The GPU section did not run" in text
    assert "a loaded machine" in text
    assert "tok/s table" in text


def test_committed_reports_show_no_machine_paths():
    """Reports under docs/results name files relative to the repository, never a machine's absolute path."""
    import re

    pattern = re.compile(r"(?<![\w.~])/(?:work|home|root|tmp|Users|mnt|scratch)/")
    files = [p for p in (REPO / "docs" / "results").rglob("*") if p.suffix in (".md", ".json")]
    assert files
    bad = [f"{p.relative_to(REPO)}:{i}" for p in files
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not bad, bad


def test_startup_bench_interleaves_the_arms_and_reports_medians_and_ratios(monkeypatch, capsys):
    st = _load("startup")
    order = []

    def fake_sample(eager):
        order.append("eager" if eager else "deferred")
        n = order.count(order[-1])
        return {"wall": (4.0 if eager else 2.0) * n, "cpu": (3.0 if eager else 1.5) * n, "dynamo": eager}

    monkeypatch.setattr(st, "sample", fake_sample)
    res = st.main(["--samples", "3"])
    assert order == ["deferred", "eager"] * 3
    assert res["eager"] == {"wall_s": 8.0, "cpu_s": 6.0, "dynamo_imported": True}
    assert res["deferred"] == {"wall_s": 4.0, "cpu_s": 3.0, "dynamo_imported": False}
    out = capsys.readouterr().out
    assert "start-up CPU ratio (deferred / eager): 0.50" in out and "3 samples per arm, load average" in out
    with pytest.raises(SystemExit):
        st.main(["--samples", "0"])


def test_linear_cross_entropy_bench_says_when_its_peaks_are_not_exact(monkeypatch, capsys):
    lce = _load("linear_cross_entropy")
    import ctypes

    assert lce._exact_resident_set() is True  # glibc here: the threshold is fixed and the heap trimmed

    def no_libc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert lce._exact_resident_set() is False

    def fake_measure(vocab, tp, a, exact=True):
        step = {"mib": 10.0, "s": 1.0}
        return {"megatron": step, "chunked": step, "tiles": (512, 2048), "threads": 1, "agreement": {"loss": 0.0},
                "exact_peak": exact}

    monkeypatch.setattr(lce, "measure", fake_measure)
    lce.main(["--vocab", "64", "--tp", "1"])
    assert "NOT exact" not in capsys.readouterr().out
    monkeypatch.setattr(lce, "measure", lambda vocab, tp, a: fake_measure(vocab, tp, a, exact=tp == 1))
    lce.main(["--vocab", "64", "--tp", "1", "2"])
    assert "peak memory NOT exact" in capsys.readouterr().out
