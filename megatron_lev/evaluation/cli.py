"""Command line of ``tools/evaluate.py`` (the library entry point is :func:`main`).

Evaluate a checkpoint (at any TP/PP, under torchrun) or a Hugging Face directory::

    torchrun --nproc-per-node 2 tools/evaluate.py --load runs/lev/ckpt --tensor-model-parallel-size 2 \\
        --valid-data data/pile_val_text_document --token-counts data/pile_train_text_token_counts.npy \\
        --zeroshot-data ../shared/data/corpus/zeroshot_wiki.jsonl.zst \\
        --tasks all --downstream-dir ../shared/data/downstream --output-dir runs/lev/eval

    python tools/evaluate.py --hf-model runs/lev/hf --valid-data val.jsonl.zst --output-dir runs/lev/eval_hf

Compare result files (the first is the reference)::

    python tools/evaluate.py --compare runs/tied/eval/results.json runs/lev/eval/results.json \\
        --labels tied lev --output-dir runs/compare
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_lev._procutil import interrupted, unwritable
from megatron_lev.data.datasets import DatasetValidationError, check_dataset_token_ids, validate_dataset_prefix
from megatron_lev.distributed import destroy_distributed, init_distributed, report_error
from megatron_lev.jsonl import expand_inputs
from megatron_lev.checkpoint import CheckpointError, check_checkpoint_tokenizer, check_intact, mark_verified, \
    open_checkpoint, verify_checksums
from megatron_lev.config import ConfigError, RunConfig
from megatron_lev.tokenizer import ALLOW_TOKENIZER_MISMATCH_FLAG, TokenizerSpec, tokenizer_fingerprint
from megatron_lev.tokenizer.fingerprint import check_dataset_tokenizer, directory_fingerprints, read_sidecar, \
    same_tokenizer, sidecar_path

from .hf_scorer import HFScorer
from .megatron_scorer import EvalSetupError, MegatronScorer
from .perplexity import (
    DataFormatError,
    documents_from_path,
    evaluate_perplexity,
    first_document,
    is_indexed_prefix,
    load_token_counts,
    parse_edges,
    stratify,
    stratify_by_exposure,
)
from .report import write_comparison, write_report
from .scorer import PROGRESS_SECONDS
from .tasks import (
    ALL_TASKS,
    LAMBADA_FILE,
    MC_TASKS,
    evaluate_lambada,
    evaluate_multiple_choice,
    load_lambada,
    load_mc_examples,
)

EXIT_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


class UsageError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="evaluate.py", description="Perplexity, frequency-stratified perplexity, zero-shot "
                "perplexity, LAMBADA and multiple-choice evaluation of a megatron-lev checkpoint or a HF model.",
                allow_abbrev=False)
    g = p.add_argument_group("model (one of)")
    g.add_argument("--load", help="checkpoint directory of pretrain_lev.py (--save DIR)")
    g.add_argument("--no-ckpt-checksums", action="store_true",
                   help="check --load's files by size only (by default they are verified against the checksums.json "
                        "of the save, reading the checkpoint once more, spread over the ranks)")
    g.add_argument("--allow-missing-ckpt-checksums", action="store_true",
                   help="evaluate a checkpoint whose checksums.json is missing though its save recorded one (its "
                        "files checked for size only; without this flag it is refused)")
    g.add_argument("--hf-model", help="Hugging Face causal-LM directory (e.g. an export)")
    g.add_argument("--compare", nargs="+", metavar="RESULTS.json",
                   help="compare result files instead of evaluating (the first is the reference)")
    g.add_argument("--labels", nargs="+", help="names of the compared runs (default: input_embedding or file name)")

    g = p.add_argument_group("layout and batching")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    g.add_argument("--num-microbatches", type=int, default=None, help="micro-batches per forward (default 2 x PP)")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="HF model device (default cuda if available)")

    g = p.add_argument_group("tokenizer (default: the checkpoint's)")
    # Unset flags fall back to the checkpoint's saved settings (TokenizerSpec.from_args(flags, saved)).
    TokenizerSpec.add_flags(g, names=("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"))
    g.add_argument(ALLOW_TOKENIZER_MISMATCH_FLAG, action="store_true",
                   help="evaluate with another tokenizer than the checkpoint's or an indexed set's (warns "
                        "instead of refusing)")

    g = p.add_argument_group("perplexity")
    g.add_argument("--valid-data", nargs="*", default=[], metavar="[NAME=]PATH",
                   help="indexed prefix (PATH.bin/.idx) or .jsonl(.gz/.zst) file(s); NAME defaults to 'valid'")
    g.add_argument("--zeroshot-data", nargs="*", default=[], metavar="[NAME=]PATH",
                   help="distribution-shifted text (e.g. zeroshot_wiki.jsonl.zst, WikiText-103); NAME 'zeroshot'")
    g.add_argument("--json-key", default="text")
    g.add_argument("--seq-length", type=int, default=None, help="window length (default: the model's)")
    g.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: --seq-length)")
    g.add_argument("--max-tokens", type=int, default=None, help="stop after about this many tokens per set")
    g.add_argument("--max-documents", type=int, default=None, help="documents per set")
    g.add_argument("--sample-tokens", type=int, default=None, metavar="N",
                   help="score documents spread evenly over each set, about N tokens of them (unlike "
                        "--max-documents and --max-tokens, which take its first ones)")
    g.add_argument("--token-counts", default=None, help="training *_token_counts.npy for frequency buckets")
    g.add_argument("--freq-edges", default=None, help="comma-separated relative-frequency edges "
                   "(default the paper's 1e-7,1e-6,1e-5,1e-4)")

    g = p.add_argument_group("downstream tasks")
    g.add_argument("--tasks", default="", help="comma list of lambada,hellaswag,piqa,winogrande,arc_easy,"
                   "arc_challenge, or 'all'")
    g.add_argument("--downstream-dir", default=None, help="folder with the tasks' jsonl files (standard names)")
    g.add_argument("--task-file", nargs="*", default=[], metavar="TASK=PATH", help="a task's file, overriding the folder")
    g.add_argument("--limit", type=int, default=None, help="first N examples per task (quick runs)")

    g = p.add_argument_group("output")
    g.add_argument("--output-dir", required=False, help="results.json, results.md and PNGs go here")
    g.add_argument("--label", default=None, help="name of this run in comparisons")
    g.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    g.add_argument("--progress-interval", type=_seconds, default=None, metavar="SECONDS",
                   help=f"seconds between progress lines when standard error is not a terminal (default "
                        f"{PROGRESS_SECONDS:g}; 0: a line per batch); on a terminal a tqdm bar")
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _named(items: Sequence[str], default: str) -> List[Tuple[str, str]]:
    out = []
    for i, it in enumerate(items):
        if "=" in it and not os.path.exists(it):
            name, path = it.split("=", 1)
        else:
            name, path = (default if i == 0 else f"{default}{i + 1}"), it
        out.append((name, path))
    return out


def task_files(args) -> Dict[str, str]:
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if names == ["all"]:
        names = list(ALL_TASKS)
    for t in names:
        if t not in ALL_TASKS:
            raise UsageError(f"--tasks: unknown task {t!r} (choose from {', '.join(ALL_TASKS)} or all)")
    explicit = {}
    for it in args.task_file:
        if "=" not in it:
            raise UsageError(f"--task-file {it!r}: expected TASK=PATH")
        t, path = it.split("=", 1)
        if t not in ALL_TASKS:
            raise UsageError(f"--task-file: unknown task {t!r}")
        explicit[t] = path
        if t not in names:
            names.append(t)
    out = {}
    for t in names:
        if t in explicit:
            out[t] = explicit[t]
        elif args.downstream_dir:
            out[t] = os.path.join(args.downstream_dir, LAMBADA_FILE if t == "lambada" else MC_TASKS[t][0])
        else:
            raise UsageError(f"task {t}: give --downstream-dir DIR or --task-file {t}=PATH")
    return out


def check_inputs(args) -> Dict[str, Any]:
    """Read every task file and check the data paths before any model is loaded, so a malformed
    file fails fast with one line naming the file and line. Returns the parsed task examples."""
    if args.sample_tokens is not None and args.sample_tokens < 1:
        raise UsageError(f"--sample-tokens {args.sample_tokens}: give at least 1 token")
    for flag in ("max_documents", "max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: nothing would be evaluated; "
                             "give at least 1 (or leave it out)")
    for flag, items, default in (("--valid-data", args.valid_data, "valid"),
                                 ("--zeroshot-data", args.zeroshot_data, "zeroshot")):
        for _, path in _named(items, default):
            check_eval_set(flag, path, args.json_key)
    if args.token_counts and not os.path.isfile(args.token_counts):
        raise DataFormatError(f"--token-counts {args.token_counts}: no such file")
    return {t: (load_lambada(p, args.limit) if t == "lambada" else load_mc_examples(t, p, args.limit))
            for t, p in task_files(args).items()}


def check_eval_set(flag: str, path: str, key: str) -> None:
    """Refuse (one line naming the file) an evaluation set that is missing, damaged or holds nothing to score:
    a perplexity over 0 tokens is no score (it printed PPL 1.0). An indexed set is checked as training checks
    one (its .idx against its .bin), without megatron-core's reader, whose failures are tracebacks."""
    if is_indexed_prefix(path):
        try:
            info = validate_dataset_prefix(path, check_token_ids=False)
        except DatasetValidationError as e:
            raise DataFormatError(f"{flag} {e}") from None
        if info.num_tokens == 0:
            raise DataFormatError(f"{flag} {path}: an empty indexed set ({path}.idx lists 0 tokens); nothing to "
                                  "evaluate, give a set with documents")
        return
    try:
        files = expand_inputs([p for p in path.split(",") if p])
    except FileNotFoundError:
        raise DataFormatError(f"{flag} {path}: neither an indexed prefix ({path}.bin/.idx) nor a jsonl file") from None
    if first_document(files, key) is None:
        raise DataFormatError(f"{flag} {path}: no document (no line with a non-empty string under {key!r}); nothing "
                              "to evaluate, give a file with documents (or the right --json-key)")


def run_evaluation(scorer, tokenizer, args, meta: Dict[str, Any], log=print,
                   examples: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every requested evaluation; returns the result dictionary (see ``report``)."""
    progress = not args.no_progress
    seconds = PROGRESS_SECONDS if args.progress_interval is None else args.progress_interval
    results: Dict[str, Any] = {"meta": meta, "perplexity": {}, "tasks": {}}
    edges = parse_edges(args.freq_edges)
    counts = load_token_counts(args.token_counts) if args.token_counts else None
    sets = _named(args.valid_data, "valid") + _named(args.zeroshot_data, "zeroshot")
    if (sets or task_files(args)) and tokenizer is None:
        raise UsageError("no tokenizer: give --tokenizer-type and its files")
    tasks = task_files(args)
    announce = _announcer(len(sets) + len(tasks), progress and scorer.is_main)
    for name, path in sets:
        announce(f"{name} (perplexity of {path})")
        t0 = time.time()
        docs = documents_from_path(path, tokenizer, key=args.json_key, limit=args.max_documents,
                                   sample_tokens=args.sample_tokens)
        res = evaluate_perplexity(scorer, docs, eod=tokenizer.eod, name=name, source=os.path.abspath(path),
                                  seq_length=args.seq_length, stride=args.stride, max_tokens=args.max_tokens,
                                  progress=progress, progress_seconds=seconds)
        entry = res.to_dict()
        if counts is not None:
            entry["frequency_buckets"] = stratify(res.nll_by_id, res.count_by_id, counts, edges)
            entry["exposure_buckets"] = stratify_by_exposure(res.nll_by_id, res.count_by_id, counts)
            entry["token_counts"] = os.path.abspath(args.token_counts)
            entry["freq_edges"] = list(edges)
        entry["seconds"] = round(time.time() - t0, 2)
        results["perplexity"][name] = entry
        if args.output_dir:
            def write_per_token(res=res, path=os.path.join(args.output_dir, f"{name}_per_token.npz")):
                os.makedirs(args.output_dir, exist_ok=True)
                res.save_per_token(path)

            _write_on_main(scorer, write_per_token)
        log(f"{name}: {res.tokens} tokens, NLL {res.nll:.4f}, PPL {res.ppl:.3f}"
            + (f", bits/byte {res.bits_per_byte:.4f}" if res.bits_per_byte else ""))
    examples = examples or {}
    for task, path in tasks.items():
        announce(f"{task} ({path})")
        t0 = time.time()
        if task == "lambada":
            r = evaluate_lambada(scorer, tokenizer, path, args.limit, progress, requests=examples.get(task),
                                 progress_seconds=seconds)
        else:
            r = evaluate_multiple_choice(scorer, tokenizer, task, path, args.limit, progress,
                                         examples=examples.get(task), progress_seconds=seconds)
        r["seconds"] = round(time.time() - t0, 2)
        results["tasks"][task] = r
        log(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()
                                    if k in ("acc", "acc_norm", "ppl") and v is not None) + f" ({r['examples']} examples)")
    return results


def _announcer(total: int, shown: bool):
    """The line that starts each of the ``total`` evaluations (standard error, beside their progress)."""
    done = [0]

    def announce(what: str) -> None:
        done[0] += 1
        if shown:
            print(f"evaluating {done[0]}/{total}: {what}", file=sys.stderr, flush=True)

    return announce


def _write_on_main(scorer, write) -> None:
    """``write()`` on the main rank; with a checkpoint's scorer on several ranks its OSError (a full disk)
    is raised on every rank, so that no rank goes on into the next evaluation's collectives, and waits
    there, without the main one."""
    error = None
    if scorer.is_main:
        try:
            write()
        except OSError as e:
            error = e
    if isinstance(scorer, MegatronScorer) and torch.distributed.get_world_size() > 1:
        from megatron_lev.parallel.collectives import broadcast_object

        error = broadcast_object(error)  # once per evaluated set
    if error is not None:
        raise error


def _tokenizer_for_checkpoint(args, saved: Dict[str, Any]):
    """The tokenizer of the flags, else of the checkpoint's saved arguments; None when neither names one."""
    spec = TokenizerSpec.from_args(args, saved)
    if spec is None:
        return None
    try:
        return spec.build()
    except (ValueError, FileNotFoundError, OSError) as e:
        raise UsageError(f"tokenizer {spec.tokenizer_type}: {str(e).splitlines()[0]} (override with --tokenizer-type/"
                         "--vocab-file/--merge-file/--tokenizer-model)") from None


def check_tokenizer(args, tokenizer, saved: Optional[Dict[str, Any]] = None, where: str = "") -> None:
    """Refuse (UsageError, one line naming both) a tokenizer other than the checkpoint's (``saved``
    arguments of ``where``) or than the one an indexed ``--valid-data``/``--zeroshot-data`` set was
    made with, unless --allow-tokenizer-mismatch; and, mismatch allowed or not, an indexed set holding a
    token id the tokenizer cannot decode or the checkpoint's model cannot embed (training's check)."""
    if tokenizer is None:
        return
    fp = tokenizer_fingerprint(tokenizer)
    allow = bool(getattr(args, "allow_tokenizer_mismatch", False))
    if saved is not None:
        try:
            check_checkpoint_tokenizer(saved, fp, tokenizer.tokenizer_type, where, allow_mismatch=allow, log=_log)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    for _, path in _named(args.valid_data, "valid") + _named(args.zeroshot_data, "zeroshot"):
        if is_indexed_prefix(path):
            try:
                check_dataset_tokenizer(path, fp, allow_mismatch=allow, warn=_log)
                check_dataset_token_ids(path, *_vocabulary(tokenizer, saved))
            except ValueError as e:
                raise UsageError(str(e)) from None


def _vocabulary(tokenizer, saved: Optional[Dict[str, Any]]) -> Tuple[int, str]:
    """The smaller of the tokenizer's vocabulary and the checkpoint's (padded) one, and whose it is."""
    limits = [(int(tokenizer.vocab_size), "the tokenizer's vocabulary size")]
    try:
        rows = RunConfig.from_saved_args(saved).model.padded_vocab_size if saved else None
    except ConfigError as e:  # a hand-edited config.yaml
        raise UsageError(str(e)) from None
    if rows:
        limits.append((rows, "the checkpoint's vocabulary size"))
    return min(limits)


def _log(msg: str) -> None:
    """Print on the first rank only."""
    if os.environ.get("RANK", "0") == "0":
        print(msg, flush=True)


def _warn(msg: str) -> None:
    """A warning line, on standard error (the first rank only)."""
    if os.environ.get("RANK", "0") == "0":
        print(msg, file=sys.stderr, flush=True)


def _fail(msg: str) -> int:
    """One error line (first rank; every rank's line goes to torchrun's failure summary) and the exit status."""
    report_error(msg, show=os.environ.get("RANK", "0") == "0")
    return EXIT_ERROR


def _compare(args) -> int:
    if not args.output_dir:
        return _fail("--compare needs --output-dir")
    try:
        out = write_comparison(args.compare, args.output_dir, args.labels)
    except ValueError as e:
        return _fail(str(e))
    with open(out["markdown"], encoding="utf-8") as f:
        _log(f.read())
    _log(f"wrote {', '.join(out.values())}")
    return 0


def _hf_model(args, meta: Dict[str, Any]):
    """The scorer and tokenizer of ``--hf-model`` (its own tokenizer unless --tokenizer-type is given)."""
    if args.tokenizer_type is None:
        _check_hf_model_tokenizer(args)
    scorer = HFScorer(args.hf_model, batch_size=args.micro_batch_size, device=args.device, dtype=args.hf_dtype,
                      max_length=args.seq_length)
    tokenizer = scorer.tokenizer() if args.tokenizer_type is None else _tokenizer_for_checkpoint(args, {})
    if args.tokenizer_type is not None:
        check_tokenizer(args, tokenizer)
    meta.update(model=scorer.description, hf_model=os.path.abspath(args.hf_model))
    return scorer, tokenizer


def _check_hf_model_tokenizer(args) -> None:
    """``--hf-model`` with its own tokenizer: the indexed sets must have been made with it (the
    fingerprint its export recorded, or one of its tokenizer files'), checked before the model loads."""
    sets = [p for _, p in _named(args.valid_data, "valid") + _named(args.zeroshot_data, "zeroshot")
            if is_indexed_prefix(p)]
    if not sets:
        return  # text is tokenized by the model's own tokenizer
    try:
        fps = directory_fingerprints(args.hf_model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not fps:
        _log(f"WARNING: --hf-model {args.hf_model}: no tokenizer file to fingerprint (tokenizer.json, vocab.json + "
             f"merges.txt or tokenizer.model), so the tokenizer of {', '.join(sets)} is not checked; pass "
             "--tokenizer-type and its files to check it")
        return
    allow = bool(getattr(args, "allow_tokenizer_mismatch", False))
    for path in sets:
        try:
            recorded = read_sidecar(sidecar_path(path))
            current = next((fp for fp in fps if recorded and same_tokenizer(recorded, fp)), fps[0])
            check_dataset_tokenizer(path, current, allow_mismatch=allow, warn=_log)
        except ValueError as e:
            raise UsageError(f"{e} (the tokenizer of --hf-model {args.hf_model})") from None


def _older(it: int, path: str) -> str:
    """How to evaluate the newest complete older checkpoint a damage message names."""
    return f"evaluate it with --load {path}"


def _checkpoint_tokenizer(args, iteration: Optional[int] = None):
    """The tokenizer of ``--load`` (flags over its saved arguments; its tracker's checkpoint, or
    ``iteration``'s), checked against the checkpoint's and the indexed sets' before any model is built;
    then the checkpoint's files are checked."""
    try:
        saved = open_checkpoint(args.load, iteration, read_common=False, older_hint=_older)
        tokenizer = _tokenizer_for_checkpoint(args, saved.args)
        check_tokenizer(args, tokenizer, saved.args, saved.path)
        # Sizes here, in every process before the process group exists; the checksums once it does.
        check_intact(saved.root, saved.iteration, saved.path, _older, checksums=False)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    return tokenizer, saved


def _rank0_checkpoint(args, tokenizer, saved):
    """Collective. (tokenizer, checkpoint, this rank's error or None) for rank 0's checkpoint of ``--load``.
    Each rank found its own before the process group existed: a rank that looked after a save of the
    training run that writes ``--load`` completed found the newer iteration, and ranks verifying and
    loading different iterations refuse the checkpoint as damaged or load a model of two of them."""
    from megatron_lev.parallel.collectives import broadcast_object

    iteration = broadcast_object(saved.iteration)
    if iteration == saved.iteration:
        return tokenizer, saved, None
    try:
        tokenizer, saved = _checkpoint_tokenizer(args, iteration)
    except (ValueError, OSError) as e:  # UsageError included; stops every rank with this line (verify_checksums)
        text = str(e).strip()
        if isinstance(e, UsageError):
            return tokenizer, saved, text
        return tokenizer, saved, (f"--load {args.load}: iteration {iteration} cannot be opened on this rank "
                                  f"({type(e).__name__}: {text.splitlines()[0] if text else 'no detail'})")
    return tokenizer, saved, None


def _verify_checkpoint(args, saved, local_error: Optional[str] = None) -> None:
    """The checkpoint's files against its checksums, spread over the ranks (every rank reads its share, all
    stop with the same line on damage or on a rank's ``local_error``); the later opens in this process do
    not read it again."""
    try:
        verify_checksums(saved.root, saved.iteration, saved.path, _older, _warn, local_error=local_error,
                         checksums_on=not args.no_ckpt_checksums, allow_missing=args.allow_missing_ckpt_checksums)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    mark_verified(saved.path)  # verified, or --no-ckpt-checksums: sizes only


def _checkpoint_model(args, meta: Dict[str, Any], tokenizer, iteration: int):
    """The scorer of ``--load``'s ``iteration`` at the requested TP/PP (process groups already set up)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    scorer, _, info = MegatronScorer.from_checkpoint(
        args.load, tp=tp, pp=pp, iteration=iteration, micro_batch_size=args.micro_batch_size,
        num_microbatches=args.num_microbatches, max_length=args.seq_length, log=_log)
    meta.update(model=scorer.description, checkpoint=info["checkpoint"], iteration=info["iteration"],
                iteration_dir=info["iteration_dir"], config=info["config"], tp=tp, pp=pp,
                world_size=torch.distributed.get_world_size())
    return scorer, tokenizer


def _write_failure(out_dir: str, e: OSError) -> str:
    """One line for an OSError of the evaluation: where it happened and, for a full disk, the free space."""
    where = e.filename or out_dir
    if e.errno == errno.ENOSPC or "No space left on device" in str(e):
        free = f"{shutil.disk_usage(out_dir).free / 2**30:.1f} GiB" if os.path.isdir(out_dir) else "unknown"
        return (f"--output-dir {out_dir}: no space left on the device while writing the results ({free} free); "
                "each result file there is whole or absent (the one under way was removed); free space and run again")
    inside = os.path.abspath(str(where)).startswith(os.path.abspath(out_dir))
    return (f"--output-dir {out_dir}: cannot write {where} ({e.strerror or e}); each result file there is whole or "
            "absent" if inside else f"{where}: {e.strerror or e}")


def results_size(args) -> int:
    """Bytes to find free in --output-dir before the evaluation runs: 1 MiB for the reports and plots, 4 MiB
    per perplexity set (its per-token file holds 16 bytes per vocabulary id: 4 MiB at 256k ids)."""
    return (1 + 4 * (len(args.valid_data) + len(args.zeroshot_data))) * 2**20


def _evaluate(args, command: str) -> int:
    """Check the inputs, load the model, evaluate and write the report."""
    meta: Dict[str, Any] = {"label": args.label, "command": command, "limit": args.limit,
                            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    dist_setup = None
    try:
        why = unwritable(args.output_dir, reserve=results_size(args))  # before the work whose results it keeps
        if why:
            raise UsageError(f"--output-dir {args.output_dir}: {why}; "
                             + ("free space or choose another directory" if why.startswith("no space")
                                else "choose a writable directory"))
        examples = check_inputs(args)  # before loading anything
        if args.hf_model:
            scorer, tokenizer = _hf_model(args, meta)
        else:
            tokenizer, saved = _checkpoint_tokenizer(args)
            dist_setup = init_distributed(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                                          backend=args.distributed_backend, seed=1234)
            tokenizer, saved, local_error = _rank0_checkpoint(args, tokenizer, saved)
            _verify_checkpoint(args, saved, local_error)
            scorer, tokenizer = _checkpoint_model(args, meta, tokenizer, saved.iteration)
        t0 = time.time()
        results = run_evaluation(scorer, tokenizer, args, meta, log=_log, examples=examples)
        meta["seconds"] = round(time.time() - t0, 2)
        if scorer.is_main:
            paths = write_report(results, args.output_dir)
            _log(f"wrote {', '.join(paths.values())}")
        return 0
    except (UsageError, EvalSetupError, DataFormatError, ValueError, FileNotFoundError) as e:
        return _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    except OSError as e:  # writing the results: a disk that filled, a folder made read-only during the work
        return _fail(_write_failure(args.output_dir, e))
    except KeyboardInterrupt:
        return interrupted(f"interrupted (Ctrl-C); --output-dir {args.output_dir}: each file of this run there is "
                           "whole or absent (results.json and results.md are written at the end)", show=os.environ.get("RANK", "0") == "0")
    finally:
        if dist_setup is not None:
            destroy_distributed(dist_setup)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        return _fail(str(e))
    if args.compare:
        return _compare(args)
    if args.progress_interval is not None and args.no_progress:
        return _fail("--progress-interval sets the progress lines that --no-progress turns off; give one of them")
    if bool(args.load) == bool(args.hf_model):
        return _fail("give exactly one of --load DIR, --hf-model DIR (or --compare FILES)")
    if not args.output_dir:
        return _fail("--output-dir is required")
    return _evaluate(args, " ".join(sys.argv if argv is None else ["evaluate.py", *argv]))
