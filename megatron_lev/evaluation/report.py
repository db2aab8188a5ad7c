"""Result files (JSON), markdown tables, PNG plots, and the comparison of several result files.

A result file::

    {"meta": {"model", "checkpoint", "iteration", "config", "tp", "pp", ..., "created"},
     "perplexity": {NAME: {"source", "tokens", "documents", "bytes", "nll", "ppl", "bits_per_byte",
                           "seq_length", "stride", "frequency_buckets": [{"bucket", "lo", "hi",
                           "tokens", "vocab_ids", "nll", "ppl"}, ...], "token_counts": PATH}},
     "tasks": {TASK: {"examples", "acc", "acc_stderr", ...}}}

Comparison: the first file is the reference; for every perplexity set present in all files the
relative PPL change per frequency bucket is ``ppl / ppl_ref - 1`` (negative = better than the
reference), plus the change of the overall PPL and the accuracy differences on tasks.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from megatron_lev._procutil import atomic_path

NA = "–"


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return NA
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if abs(v) >= 1e5:
            return f"{v:.4g}"
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: Sequence[str], rows: List[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(x) if not isinstance(x, str) else x for x in r) + " |")
    return "\n".join(lines)


def write_json(results: Dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")


def _save_figure(fig, path: str) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def load_results(path: str) -> Dict[str, Any]:
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a result file ({e})") from None
    if not isinstance(data, dict) or "meta" not in data:
        raise ValueError(f"{path}: not a result file of tools/evaluate.py (no 'meta')")
    return data


def results_markdown(results: Dict[str, Any]) -> str:
    meta = results.get("meta", {})
    out = ["# Evaluation results", ""]
    out.append(f"- model: `{meta.get('model', NA)}`")
    if meta.get("checkpoint"):
        out.append(f"- checkpoint: `{meta['checkpoint']}` (iteration {meta.get('iteration', NA)})")
    cfg = meta.get("config") or {}
    if cfg:
        keys = ("input_embedding", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "padded_vocab_size")
        out.append("- model config: " + ", ".join(f"{k}={cfg.get(k)}" for k in keys if k in cfg))
    if meta.get("limit") is not None:
        out.append(f"- --limit {meta['limit']} (a quick run: not comparable to full-set numbers)")
    out.append("")
    ppl = results.get("perplexity") or {}
    if ppl:
        out += ["## Perplexity", "", _table(
            ["set", "source", "tokens", "mean NLL (nats)", "PPL", "bits/byte", "window", "stride"],
            [[n, f"`{os.path.basename(str(r.get('source', '')))}`", r.get("tokens"), r.get("nll"), r.get("ppl"),
              r.get("bits_per_byte"), r.get("seq_length"), r.get("stride")] for n, r in ppl.items()]), ""]
        for n, r in ppl.items():
            b = r.get("frequency_buckets")
            if not b:
                continue
            out += [f"### {n}: perplexity by training frequency of the target token", "",
                    _table(["relative frequency", "tokens", "share", "mean NLL", "PPL"],
                           [[x["bucket"], x["tokens"], x["tokens"] / max(1, r.get("tokens") or 1), x["nll"], x["ppl"]]
                            for x in b]), ""]
    tasks = results.get("tasks") or {}
    if tasks:
        rows = []
        for t, r in tasks.items():
            rows.append([t, r.get("examples"), _pm(r, "acc"), _pm(r, "acc_norm"), _pm(r, "acc_bytes"), r.get("ppl")])
        out += ["## Downstream (zero-shot, log-likelihood)", "",
                _table(["task", "examples", "acc", "acc_norm", "acc_bytes", "ppl"], rows), ""]
    return "\n".join(out)


def _pm(r: Dict[str, Any], m: str) -> str:
    if r.get(m) is None:
        return NA
    se = r.get(f"{m}_stderr")
    return f"{r[m]:.4f} ± {se:.4f}" if se is not None else f"{r[m]:.4f}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_results(results: Dict[str, Any], out_dir: str, prefix: str = "") -> List[str]:
    """``{prefix}freq_ppl.png`` (PPL per frequency bucket, per set) and ``{prefix}tasks.png``; returns paths."""
    paths = []
    ppl = {n: r for n, r in (results.get("perplexity") or {}).items() if r.get("frequency_buckets")}
    if ppl:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [b["bucket"] for b in next(iter(ppl.values()))["frequency_buckets"]]
        width = 0.8 / len(ppl)
        for i, (n, r) in enumerate(ppl.items()):
            vals = [b["ppl"] if b["ppl"] is not None else float("nan") for b in r["frequency_buckets"]]
            ax.bar([x + i * width for x in range(len(labels))], vals, width, label=n)
        ax.set_xticks([x + width * (len(ppl) - 1) / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, rotation=15)
        ax.set_yscale("log")
        ax.set_xlabel("relative frequency of the target token in the training data")
        ax.set_ylabel("perplexity")
        ax.set_title("Perplexity by token frequency")
        ax.legend()
        fig.tight_layout()
        p = os.path.join(out_dir, f"{prefix}freq_ppl.png")
        _save_figure(fig, p)
        plt.close(fig)
        paths.append(p)
    tasks = results.get("tasks") or {}
    if tasks:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(tasks)
        for i, m in enumerate(("acc", "acc_norm")):
            vals = [tasks[t].get(m) if tasks[t].get(m) is not None else float("nan") for t in names]
            errs = [tasks[t].get(f"{m}_stderr") or 0.0 for t in names]
            ax.bar([x + i * 0.4 for x in range(len(names))], vals, 0.4, yerr=errs, label=m, capsize=2)
        ax.set_xticks([x + 0.2 for x in range(len(names))])
        ax.set_xticklabels(names, rotation=15)
        ax.set_ylim(0, 1)
        ax.set_ylabel("accuracy")
        ax.set_title("Zero-shot downstream accuracy")
        ax.legend()
        fig.tight_layout()
        p = os.path.join(out_dir, f"{prefix}tasks.png")
        _save_figure(fig, p)
        plt.close(fig)
        paths.append(p)
    return paths


def _write_files(data: Dict[str, Any], out_dir: str, name: str, markdown: str, pngs: List[str]) -> Dict[str, str]:
    """``{name}.json`` of ``data`` and ``{name}.md`` of ``markdown`` with the PNGs (already in ``out_dir``)
    shown below it; returns the paths by kind ("json", "markdown") and by PNG name."""
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "markdown": os.path.join(out_dir, f"{name}.md")}
    write_json(data, paths["json"])
    if pngs:
        markdown += "\n" + "\n".join(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs) + "\n"
    with atomic_path(paths["markdown"]) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(markdown)
    for p in pngs:
        paths[os.path.splitext(os.path.basename(p))[0]] = p
    return paths


def write_report(results: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    """results.json, results.md and the PNG plots in ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    return _write_files(results, out_dir, "results", results_markdown(results), plot_results(results, out_dir))


# ------------------------------------------------------------------------------------------------
# comparison


def _label(res: Dict[str, Any], path: str) -> str:
    meta = res.get("meta", {})
    return meta.get("label") or (meta.get("config") or {}).get("input_embedding") or os.path.splitext(
        os.path.basename(os.path.dirname(os.path.abspath(path)) if os.path.basename(path) == "results.json" else path))[0]


def compare_results(paths: Sequence[str], labels: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Relative changes of every run against the first (see the module docstring)."""
    if len(paths) < 2:
        raise ValueError("comparison needs at least two result files")
    runs = [load_results(p) for p in paths]
    labels = list(labels) if labels else [_label(r, p) for r, p in zip(runs, paths)]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} result files")
    seen: Dict[str, int] = {}
    for i, lab in enumerate(labels):  # unique labels
        if lab in seen:
            labels[i] = f"{lab} ({i})"
        seen[lab] = i
    ref = runs[0]
    out: Dict[str, Any] = {"reference": labels[0], "labels": labels, "files": [os.path.abspath(p) for p in paths],
                           "perplexity": {}, "tasks": {}}
    for name, r0 in (ref.get("perplexity") or {}).items():
        if not all(name in (r.get("perplexity") or {}) for r in runs):
            continue
        entry: Dict[str, Any] = {"ppl": [r["perplexity"][name]["ppl"] for r in runs],
                                 "tokens": [r["perplexity"][name]["tokens"] for r in runs]}
        entry["relative_change"] = [p / entry["ppl"][0] - 1.0 for p in entry["ppl"]]
        buckets0 = r0.get("frequency_buckets")
        if buckets0 and all(
                [b["bucket"] for b in (r["perplexity"][name].get("frequency_buckets") or [])] == [b["bucket"] for b in buckets0]
                for r in runs):
            rows = []
            for j, b in enumerate(buckets0):
                ppls = [r["perplexity"][name]["frequency_buckets"][j]["ppl"] for r in runs]
                rows.append({"bucket": b["bucket"], "tokens": [r["perplexity"][name]["frequency_buckets"][j]["tokens"] for r in runs],
                             "ppl": ppls,
                             "relative_change": [(p / ppls[0] - 1.0) if (p is not None and ppls[0]) else None for p in ppls]})
            entry["buckets"] = rows
        out["perplexity"][name] = entry
    for task, t0 in (ref.get("tasks") or {}).items():
        if not all(task in (r.get("tasks") or {}) for r in runs):
            continue
        metrics = [m for m in ("acc", "acc_norm", "acc_bytes", "ppl") if t0.get(m) is not None]
        out["tasks"][task] = {m: [r["tasks"][task].get(m) for r in runs] for m in metrics}
    return out


def comparison_markdown(cmp: Dict[str, Any]) -> str:
    labels = cmp["labels"]
    others = labels[1:]
    out = ["# Comparison", "", f"Reference: **{labels[0]}**; relative change = PPL / PPL(reference) − 1 "
           "(negative: lower perplexity than the reference).", ""]
    for name, e in cmp["perplexity"].items():
        out.append(f"## {name}")
        out.append("")
        rows = [["all tokens", _fmt(e["tokens"][0])] + [_fmt(p) for p in e["ppl"]] +
                [_pct(c) for c in e["relative_change"][1:]]]
        for b in e.get("buckets", []):
            rows.append([b["bucket"], _fmt(b["tokens"][0])] + [_fmt(p) for p in b["ppl"]] +
                        [_pct(c) for c in b["relative_change"][1:]])
        out += [_table(["relative frequency", "tokens"] + [f"PPL {lab}" for lab in labels] +
                       [f"Δ {lab}" for lab in others], rows), ""]
    if cmp["tasks"]:
        rows = []
        for task, ms in cmp["tasks"].items():
            for m, vals in ms.items():
                diff = [(v - vals[0]) if (v is not None and vals[0] is not None) else None for v in vals[1:]]
                rows.append([task, m] + [_fmt(v) for v in vals] + [(_fmt(d) if m == "ppl" else _pp(d)) for d in diff])
        out += ["## Tasks", "", _table(["task", "metric"] + labels + [f"Δ {lab}" for lab in others], rows), ""]
    return "\n".join(out)


def _pct(x: Optional[float]) -> str:
    return NA if x is None else f"{100 * x:+.2f}%"


def _pp(x: Optional[float]) -> str:
    return NA if x is None else f"{100 * x:+.2f} pt"


def plot_comparison(cmp: Dict[str, Any], out_dir: str) -> List[str]:
    """One PNG per perplexity set with buckets: relative PPL change per bucket of each run vs the reference."""
    paths = []
    labels = cmp["labels"]
    for name, e in cmp["perplexity"].items():
        if not e.get("buckets"):
            continue
        plt = _plt()
        fig, ax = plt.subplots(figsize=(7, 4))
        buckets = [b["bucket"] for b in e["buckets"]] + ["all"]
        n = len(labels) - 1
        width = 0.8 / n
        for i in range(1, len(labels)):
            vals = [100 * b["relative_change"][i] if b["relative_change"][i] is not None else float("nan")
                    for b in e["buckets"]] + [100 * e["relative_change"][i]]
            ax.bar([x + (i - 1) * width for x in range(len(buckets))], vals, width, label=f"{labels[i]} vs {labels[0]}")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (n - 1) / 2 for x in range(len(buckets))])
        ax.set_xticklabels(buckets, rotation=15)
        ax.set_xlabel("relative frequency of the target token in the training data")
        ax.set_ylabel("relative PPL change (%)")
        ax.set_title(f"{name}: perplexity change by token frequency")
        ax.legend()
        fig.tight_layout()
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        p = os.path.join(out_dir, f"compare_{safe}.png")
        _save_figure(fig, p)
        plt.close(fig)
        paths.append(p)
    return paths


def write_comparison(paths: Sequence[str], out_dir: str, labels: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """comparison.json, comparison.md and PNGs in ``out_dir``; returns their paths. The result files
    are recorded relative to ``out_dir``, so that the folder shows no machine's paths and can be moved
    together with the runs."""
    os.makedirs(out_dir, exist_ok=True)
    cmp = compare_results(paths, labels)
    cmp["files"] = [os.path.relpath(f, os.path.abspath(out_dir)) for f in cmp["files"]]
    return _write_files(cmp, out_dir, "comparison", comparison_markdown(cmp), plot_comparison(cmp, out_dir))
