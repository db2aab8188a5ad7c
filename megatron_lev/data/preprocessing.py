"""jsonl(.gz/.zst) -> megatron-core indexed datasets (.bin/.idx), in parallel, in input order.

Pipeline: the main process streams lines (bounded memory), cuts them into batches of at most
``batch_docs`` lines / ``batch_bytes`` bytes, and hands them to ``workers`` forked processes (one
with ``workers=1``, as Megatron-LM's tool). A worker parses JSON, checks every key, tokenises each document
into a numpy array and returns one concatenated array per key plus the document lengths. The main
process takes results strictly in submission order (a bounded window of pending batches) and
writes them, document by document, through megatron-core's ``IndexedDatasetBuilder`` under
temporary names; it renames the ``.bin`` then the ``.idx`` into place at the very end. The builder's
module is imported in a background thread started at the beginning of the run (see ``indexed.py``);
results that arrive before the import is done are held in memory and written once it is.

Document conventions:

* One input line = one document per json key, one sequence per document (no sentence splitting).
* ``append_eod`` appends the tokenizer's ``eod`` to every non-empty document, as Megatron-LM.
* Lines skipped by reason (counted; up to ``max_examples`` examples kept with ``file:line``):
  ``invalid_utf8`` (bytes not UTF-8, or lone surrogates from ``\\ud800``-style escapes),
  ``malformed_json`` (not JSON, or not a JSON object), ``missing_key``, ``non_string`` (the value
  under a key is not a string). These are *errors*: ``strict=True`` stops at the first one.
  Not errors (never stop a run): ``blank`` (empty line), ``empty`` (a key's text has no tokens;
  the whole line is dropped so every key has the same documents), ``filtered`` (pile_set_name
  not selected), and lines of other partitions.
* Output dtype: megatron-core's ``DType.optimal_dtype(tokenizer.vocab_size)`` (uint16 below 65,500
  ids, int32 otherwise). Workers send ids in the smallest integer dtype that holds every id below
  the vocabulary size; the builder casts them.
* Token counts (``output_token_counts``) count every id written to ``.bin``, EODs included, so
  ``counts.sum() == total tokens`` in the dataset; length = ``tokenizer.vocab_size``.
* Partitions: with ``partitions=N, partition_index=i`` only physical input lines ``k`` (0-based,
  counted across all input files in order) with ``k % N == i`` are processed. Merging partitions
  0..N-1 with :func:`megatron_lev.data.merge.merge_datasets` gives every document exactly once,
  partition-major (a fixed permutation of the input order).
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megatron_lev.data.indexed import BackgroundImport
from megatron_lev.jsonl import TruncatedInputError, expand_inputs, import_codecs, iter_lines
from megatron_lev.progress import Progress
from megatron_lev.tokenizer import TokenizerSpec, tokenizer_fingerprint
from megatron_lev.tokenizer.fingerprint import sidecar_path, write_sidecar

ERROR_REASONS = ("invalid_utf8", "malformed_json", "missing_key", "non_string")
SKIP_REASONS = ("blank", "empty", "filtered")


class PreprocessError(Exception):
    """A one-line error for the user (bad flag, existing output, bad input under --strict)."""


class EmptyOutputError(PreprocessError):
    """No input line gave a document (empty inputs, a --json-keys no line has, everything skipped)."""


class OutputWriteError(PreprocessError):
    """The outputs could not be written (the disk filled); the partial files are removed."""


class BadInputError(PreprocessError):
    """Bad input line met with ``strict=True``."""


@dataclass(kw_only=True)
class PreprocessConfig(TokenizerSpec):
    """What to preprocess and how; the tokenizer settings are :class:`TokenizerSpec`'s fields."""

    inputs: Sequence[str]
    output_prefix: str
    json_keys: Sequence[str] = ("text",)
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    partitions: int = 1
    partition_index: int = 0
    pile_set_names: Optional[Sequence[str]] = None
    strict: bool = False
    allow_truncated_input: bool = False  # keep the complete lines of a truncated/corrupt input (reported)
    allow_empty_output: bool = False  # write a dataset of 0 documents instead of refusing (EmptyOutputError)
    overwrite: bool = False
    output_token_counts: bool = False
    batch_docs: int = 128
    batch_bytes: int = 4 << 20
    max_examples: int = 5
    progress: Optional[bool] = None  # None: a tqdm bar when stderr is a terminal, log lines otherwise


@dataclass
class PreprocessStats:
    docs: int = 0
    tokens: int = 0
    bytes: int = 0
    lines: int = 0
    seconds: float = 0.0
    skipped: Counter = field(default_factory=Counter)
    examples: List[str] = field(default_factory=list)
    outputs: List[str] = field(default_factory=list)
    tokens_per_key: Dict[str, int] = field(default_factory=dict)
    damaged: List[str] = field(default_factory=list)  # inputs cut short, kept with --allow-truncated-input

    @property
    def errors(self) -> int:
        return sum(self.skipped[r] for r in ERROR_REASONS)

    def skipped_counts(self) -> str:
        """``missing_key=3, blank=1``: the skipped lines by reason (empty when none)."""
        return ", ".join(f"{r}={self.skipped[r]}" for r in ERROR_REASONS + SKIP_REASONS if self.skipped[r])

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        parts = [
            f"docs={self.docs:,}",
            f"tokens={self.tokens:,}",
            f"MB={self.bytes / 1e6:,.2f}",
            f"time={self.seconds:.2f}s",
            f"docs/s={self.docs / s:,.0f}",
            f"MB/s={self.bytes / 1e6 / s:,.2f}",
            f"tokens/s={self.tokens / s:,.0f}",
        ]
        lines = ["summary: " + " ".join(parts), f"skipped lines: {self.skipped_counts() or 'none'}"]
        if self.examples:
            lines.append("first bad lines:")
            lines += [f"  {e}" for e in self.examples]
        for d in self.damaged:
            lines.append(f"warning: {d} (kept, --allow-truncated-input)")
        return "\n".join(lines)


def dataset_prefix(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def token_counts_path(ds_prefix: str) -> str:
    """``{output_prefix}_{key}_document`` -> ``{output_prefix}_{key}_token_counts.npy``."""
    base = ds_prefix[: -len("_document")] if ds_prefix.endswith("_document") else ds_prefix
    return base + "_token_counts.npy"


def transport_dtype(vocab_size: int) -> np.dtype:
    """Smallest integer dtype holding every id below ``vocab_size`` (how workers send ids; not the output dtype)."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 31:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------

_STATE: Dict[str, Any] = {}


def _init_state(spec: TokenizerSpec, opts: Dict[str, Any], tokenizer=None) -> None:
    """The worker's tokenizer and options; ``tokenizer``: one already built from ``spec``."""
    key = (spec, repr(sorted(opts.items())))
    if _STATE.get("key") == key:
        return  # inherited through fork
    _STATE.update(tokenizer=tokenizer if tokenizer is not None else spec.build(), opts=opts, key=key)


def _worker_init(spec: TokenizerSpec, opts: Dict[str, Any]) -> None:
    from megatron_lev._procutil import ignore_interrupt

    ignore_interrupt()  # Ctrl-C: this process stops the pool and removes the partial output (one line)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    _init_state(spec, opts)


def _check_text(text: str) -> bool:
    """False for strings that cannot be UTF-8 encoded (lone surrogates)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _parse_line(line: bytes, keys: Sequence[str], pile_sets) -> Any:
    """The line's JSON object, or why it is left out: ``(reason, detail)``, reason in ERROR/SKIP_REASONS."""
    if not line.strip():
        return "blank", ""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return "invalid_utf8", f"byte {e.start}"
    try:
        obj = json.loads(s)
    except ValueError as e:
        return "malformed_json", str(e).split(":")[0]
    if not isinstance(obj, dict):
        return "malformed_json", f"a JSON {type(obj).__name__}, not an object"
    if pile_sets is not None:
        meta = obj.get("meta")
        name = meta.get("pile_set_name") if isinstance(meta, dict) else None
        if name not in pile_sets:
            return "filtered", ""
    for k in keys:
        if k not in obj:
            return "missing_key", f"no key {k!r}"
        v = obj[k]
        if not isinstance(v, str):
            return "non_string", f"{k!r} is a {type(v).__name__}"
        if not _check_text(v):
            return "invalid_utf8", f"{k!r} holds a lone surrogate"
    return obj


def _parse_lines(linenos: List[int], lines: List[bytes], keys: Sequence[str], pile_sets):
    """The texts of the good lines per key, the bad lines as (reason, lineno, detail), the skip counts."""
    texts: Dict[str, List[str]] = {k: [] for k in keys}
    errors: List[Tuple[str, int, str]] = []
    skipped: Counter = Counter()
    for lineno, line in zip(linenos, lines):
        parsed = _parse_line(line, keys, pile_sets)
        if isinstance(parsed, dict):
            for k in keys:
                texts[k].append(parsed[k])
        elif parsed[0] in SKIP_REASONS:
            skipped[parsed[0]] += 1
        else:
            errors.append((parsed[0], lineno, parsed[1]))
    return texts, errors, skipped


def _tokenize(tok, texts: Dict[str, List[str]]) -> Tuple[Dict[str, List[np.ndarray]], np.ndarray]:
    """Ids of every text, key by key, and which lines to keep: those where no key's text is empty."""
    arrays = {k: tok.tokenize_batch_to_numpy(t) for k, t in texts.items()}
    n = len(next(iter(texts.values())))
    keep = np.ones(n, dtype=bool)
    for a in arrays.values():
        keep &= np.fromiter((x.size > 0 for x in a), dtype=bool, count=n)
    return arrays, keep


def _concatenate(arrays: List[np.ndarray], keep: np.ndarray, eod: Optional[int], dtype) -> Tuple[np.ndarray, np.ndarray]:
    """One key's kept documents as one token array (each followed by ``eod`` unless None) and their lengths."""
    parts: List[np.ndarray] = []
    lengths = []
    eod_arr = None if eod is None else np.array([eod], dtype=dtype)
    for a, ok in zip(arrays, keep):
        if not ok:
            continue
        parts.append(a)
        if eod_arr is not None:
            parts.append(eod_arr)
        lengths.append(a.size + (eod_arr is not None))
    tokens = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
    return tokens, np.asarray(lengths, dtype=np.int64)


def encode_batch(batch: Tuple[int, List[int], List[bytes]]) -> Dict[str, Any]:
    """Encode one batch of raw lines (runs in a worker, or in-process with one worker)."""
    file_index, linenos, lines = batch
    tok, opts = _STATE["tokenizer"], _STATE["opts"]
    texts, errors, skipped = _parse_lines(linenos, lines, opts["json_keys"], opts["pile_set_names"])
    arrays, keep = _tokenize(tok, texts)
    n_empty = int(keep.size - keep.sum())
    if n_empty:
        skipped["empty"] += n_empty
    out: Dict[str, Any] = {
        "file_index": file_index,
        "errors": errors,
        "skipped": skipped,
        "bytes": sum(len(line) + 1 for line in lines),
        "lines": len(lines),
        "docs": int(keep.sum()),
    }
    eod = tok.eod if opts["append_eod"] else None
    for k, a in arrays.items():
        out[k] = _concatenate(a, keep, eod, opts["dtype"])
    return out


# ----------------------------------------------------------------------------------------------
# Main side
# ----------------------------------------------------------------------------------------------


def _damage_is_bad_input(lines: Iterator[Tuple[int, bytes]]) -> Iterator[Tuple[int, bytes]]:
    try:
        yield from lines
    except TruncatedInputError as e:
        raise BadInputError(f"{e}; nothing written (--allow-truncated-input keeps the complete lines)") from None


def _iter_batches(
    files: Sequence[str], cfg: PreprocessConfig, stats: PreprocessStats
) -> Iterator[Tuple[int, List[int], List[bytes]]]:
    k_global = 0
    n_parts, part = cfg.partitions, cfg.partition_index
    on_damage = stats.damaged.append if cfg.allow_truncated_input else None
    for fi, path in enumerate(files):
        linenos: List[int] = []
        lines: List[bytes] = []
        size = 0
        for lineno, line in _damage_is_bad_input(iter_lines(path, on_damage=on_damage)):
            mine = n_parts == 1 or k_global % n_parts == part
            k_global += 1
            if not mine:
                continue
            linenos.append(lineno)
            lines.append(line)
            size += len(line)
            if len(lines) >= cfg.batch_docs or size >= cfg.batch_bytes:
                yield fi, linenos, lines
                linenos, lines, size = [], [], 0
        if lines:
            yield fi, linenos, lines


class _Output:
    """One key's output: megatron-core's ``IndexedDatasetBuilder`` writing under temporary names, renamed at the end.

    The builder is made by :meth:`open` (once megatron-core's module is imported); token counts are
    kept from the first batch on.
    """

    def __init__(self, ds_prefix: str, vocab_size: int, counts: bool,
                 tokenizer_fp: Optional[Dict[str, Any]] = None) -> None:
        self.prefix = ds_prefix
        self.tokenizer_fp = tokenizer_fp
        self.tmp_fp = sidecar_path(ds_prefix) + ".partial"
        self.tmp_bin = ds_prefix + ".bin.partial"
        self.tmp_idx = ds_prefix + ".idx.partial"
        self.tmp_counts = token_counts_path(ds_prefix) + ".partial"
        os.makedirs(os.path.dirname(os.path.abspath(ds_prefix)), exist_ok=True)
        self.builder = None
        self.counts = np.zeros(vocab_size, dtype=np.int64) if counts else None
        self.tokens = 0

    def open(self, indexed_dataset, dtype) -> None:
        self.builder = indexed_dataset.IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)

    def count(self, tokens: np.ndarray) -> None:
        self.tokens += int(tokens.size)
        if self.counts is not None and tokens.size:
            c = np.bincount(tokens, minlength=self.counts.size)
            if c.size > self.counts.size:
                raise PreprocessError(
                    f"{self.prefix}: token id {c.size - 1} >= tokenizer vocab size {self.counts.size}"
                )
            self.counts += c

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Add the batch's documents (one sequence each) to the builder, as numpy views of ``tokens``."""
        if lengths.size == 0:
            return
        add = self.builder.add_document
        ends = np.cumsum(lengths).tolist()
        start = 0
        with _writing(self.prefix + ".bin"):
            for n, end in zip(lengths.tolist(), ends):
                add(tokens[start:end], [n])
                start = end

    def commit(self) -> List[str]:
        with _writing(self.prefix + ".bin"):
            self.builder.data_file.close()  # its last buffered bytes; finalize's own close is then a no-op
        with _writing(self.prefix + ".idx"):
            self.builder.finalize(self.tmp_idx)
        done = []
        if self.counts is not None:
            with _writing(token_counts_path(self.prefix)), open(self.tmp_counts, "wb") as f:
                np.save(f, self.counts)
            os.replace(self.tmp_counts, token_counts_path(self.prefix))
            done.append(token_counts_path(self.prefix))
        if self.tokenizer_fp is not None:
            with _writing(sidecar_path(self.prefix)):
                write_sidecar(self.tmp_fp, self.tokenizer_fp)
            os.replace(self.tmp_fp, sidecar_path(self.prefix))
            done.append(sidecar_path(self.prefix))
        # .bin first, then .idx: a final .idx exists only once everything is in place.
        os.replace(self.tmp_bin, self.prefix + ".bin")
        os.replace(self.tmp_idx, self.prefix + ".idx")
        return [self.prefix + ".bin", self.prefix + ".idx"] + done

    def abort(self) -> None:
        if self.builder is not None and not self.builder.data_file.closed:
            # On a full disk closing flushes the buffered bytes and fails again; the file is closed anyway.
            with contextlib.suppress(OSError):
                self.builder.data_file.close()
        for p in (self.tmp_bin, self.tmp_idx, self.tmp_counts, self.tmp_fp):
            if os.path.exists(p):
                os.remove(p)


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """An OSError of the block that names no file (a buffered write's, numpy's) names ``path``, the output
    being written (under its temporary name)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), path) from None
        raise


class _Writer:
    """Writes results in order once megatron-core's indexed_dataset module is imported; holds them until then."""

    def __init__(self, importer: BackgroundImport, outputs: Dict[str, "_Output"], vocab_size: int) -> None:
        self.importer = importer
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.held: List[Dict[str, Any]] = []
        self.ready = False

    def _open(self) -> None:
        mod = self.importer.module()  # joins the import thread
        dtype = mod.DType.optimal_dtype(self.vocab_size)
        for out in self.outputs.values():
            out.open(mod, dtype)
        self.ready = True

    def _write(self, res: Dict[str, Any]) -> None:
        for k, out in self.outputs.items():
            out.write(*res[k])

    def add(self, res: Dict[str, Any]) -> None:
        if not self.ready:
            if not self.importer.done():
                self.held.append(res)
                return
            self.flush()
        self._write(res)

    def flush(self) -> None:
        if not self.ready:
            self._open()
        for res in self.held:
            self._write(res)
        self.held.clear()


def _check_writable(cfg: PreprocessConfig) -> None:
    """Fail before reading any input when the outputs cannot be written."""
    d = os.path.dirname(os.path.abspath(dataset_prefix(cfg.output_prefix, cfg.json_keys[0])))
    try:
        os.makedirs(d, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise PreprocessError(f"--output-prefix {cfg.output_prefix}: cannot write in {d} "
                              f"({e.strerror or e}); choose a writable directory") from None


def _check_outputs(cfg: PreprocessConfig) -> None:
    _check_writable(cfg)
    for key in cfg.json_keys:
        pre = dataset_prefix(cfg.output_prefix, key)
        paths = [pre + ".bin", pre + ".idx", sidecar_path(pre)]
        if cfg.output_token_counts:
            paths.append(token_counts_path(pre))
        for p in paths:
            if os.path.exists(p) and not cfg.overwrite:
                raise PreprocessError(f"{p} exists; pass --overwrite to replace it")


def _progress(cfg: PreprocessConfig, stats: PreprocessStats) -> Progress:
    """A tqdm bar when stderr is a terminal (``cfg.progress`` None; True: a bar, False: lines), else a line each
    --log-interval docs."""
    def line(docs: int, elapsed: float) -> str:
        return f"processed {docs:,} docs ({docs / elapsed:,.0f} docs/s, {_rate(stats, elapsed)})"

    return Progress("", unit="doc", bar=cfg.progress, every=cfg.log_interval if cfg.log_interval > 0 else None,
                    line=line)


def _rate(stats: PreprocessStats, elapsed: float) -> str:
    return f"{stats.bytes / 1e6 / elapsed:.2f} MB/s, {stats.tokens / elapsed / 1e6:.2f}M tok/s"


def preprocess(cfg: PreprocessConfig) -> PreprocessStats:
    """Run the whole conversion; returns the statistics. Raises PreprocessError (one-line message)."""
    if cfg.workers < 1:
        raise PreprocessError("--workers must be >= 1")
    if cfg.partitions < 1 or not (0 <= cfg.partition_index < cfg.partitions):
        raise PreprocessError(f"--partition-index must be in [0, {cfg.partitions})")
    if not cfg.json_keys:
        raise PreprocessError("--json-keys needs at least one key")
    try:
        files = expand_inputs(cfg.inputs)
    except FileNotFoundError as e:
        raise PreprocessError(str(e)) from None
    _check_outputs(cfg)
    spec = TokenizerSpec.from_args(cfg)  # just the tokenizer's settings, for the workers
    if spec is None:
        raise PreprocessError("--tokenizer-type is required")
    try:
        tokenizer = spec.build()
    except (ValueError, FileNotFoundError) as e:
        raise PreprocessError(str(e)) from None
    opts = dict(
        json_keys=tuple(cfg.json_keys),
        append_eod=cfg.append_eod,
        pile_set_names=None if cfg.pile_set_names is None else frozenset(cfg.pile_set_names),
        dtype=transport_dtype(tokenizer.vocab_size),
    )
    _STATE.clear()
    _init_state(spec, opts, tokenizer)  # forked workers inherit it

    stats = PreprocessStats()
    fp = tokenizer_fingerprint(tokenizer)
    outputs = {
        k: _Output(dataset_prefix(cfg.output_prefix, k), tokenizer.vocab_size, cfg.output_token_counts,
                   fp)
        for k in cfg.json_keys
    }
    progress = _progress(cfg, stats)
    pool = None
    t0 = time.perf_counter()
    try:
        # Workers encode (one worker too, as Megatron-LM's Pool(1)); this process reads, writes and
        # meanwhile imports megatron-core's indexed_dataset module in a thread, started after the
        # fork so that no child inherits a half-done import.
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        pool = ctx.Pool(
            cfg.workers,
            initializer=_worker_init,
            initargs=(spec, opts),
        )
        import_codecs(files)  # before megatron-core's import starts in its thread
        importer = BackgroundImport()
        batches = _iter_batches(files, cfg, stats)
        results = _ordered_results(pool, batches, window=4 * cfg.workers)
        writer = _Writer(importer, outputs, tokenizer.vocab_size)
        for res in results:
            _consume(res, files, cfg, stats, outputs)
            writer.add(res)
            progress.update(res["docs"], postfix=_rate(stats, max(time.perf_counter() - t0, 1e-9)))
        writer.flush()
        if stats.docs == 0 and not cfg.allow_empty_output:
            raise EmptyOutputError(
                f"no documents from {len(files)} input file(s) ({stats.lines:,} lines read; skipped: "
                f"{stats.skipped_counts() or 'none'}; --json-keys {' '.join(cfg.json_keys)}); nothing written; "
                "check the inputs and --json-keys, or pass --allow-empty-output to write an empty dataset")
        stats.seconds = time.perf_counter() - t0
        for out in outputs.values():
            stats.outputs += out.commit()
        stats.tokens_per_key = {k: o.tokens for k, o in outputs.items()}
    except BaseException as e:
        for out in outputs.values():
            out.abort()
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            d = os.path.dirname(os.path.abspath(dataset_prefix(cfg.output_prefix, cfg.json_keys[0])))
            where = f", while writing {_final_name(e.filename)}" if e.filename else ""
            raise OutputWriteError(
                f"--output-prefix {cfg.output_prefix}: no space left on device in {d} after {stats.docs:,} documents"
                f"{where} ({shutil.disk_usage(d).free / 2**30:.1f} GiB free there); the partial files were removed, "
                "nothing was written; make room and run again") from None
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return stats


def _final_name(path) -> str:
    """The output a temporary ``*.partial`` file becomes."""
    path = os.fspath(path)
    return path[: -len(".partial")] if path.endswith(".partial") else path


def _ordered_results(pool, batches, window: int) -> Iterator[Dict[str, Any]]:
    """Results in submission order, with at most ``window`` batches in flight (bounded memory)."""
    pending: deque = deque()
    for b in batches:
        pending.append(pool.apply_async(encode_batch, (b,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _consume(res, files, cfg: PreprocessConfig, stats: PreprocessStats, outputs: Dict[str, _Output]) -> None:
    path = files[res["file_index"]]
    for reason, lineno, detail in res["errors"]:
        where = f"{path}:{lineno}: {reason} ({detail})"
        if cfg.strict:
            raise BadInputError(f"{where}; stopping because of --strict")
        stats.skipped[reason] += 1
        if len(stats.examples) < cfg.max_examples:
            stats.examples.append(where)
    stats.skipped.update(res["skipped"])
    stats.bytes += res["bytes"]
    stats.lines += res["lines"]
    stats.docs += res["docs"]
    for k, out in outputs.items():
        tokens, _ = res[k]
        out.count(tokens)
        stats.tokens += int(tokens.size)
