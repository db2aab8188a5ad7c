"""Perplexity over a token stream, and frequency-stratified perplexity.

The stream is built as in Megatron pretraining: documents one after another, each followed by the
end-of-document token (documents of an indexed dataset written with ``--append-eod`` already end
with it). One EOD is put *in front* of the stream, so the first token of the first document is
scored too; every token of every document and every separator is then scored exactly once, and
bits per byte relate the whole NLL to the documents' UTF-8 bytes (lm-evaluation-harness's
``bits_per_byte``: sum of NLL in nats / ln 2 / bytes).

Windows: ``seq_length`` targets per window with ``seq_length`` tokens of input (a window holds
``seq_length + 1`` tokens). ``stride = seq_length`` (default) gives Megatron's non-overlapping
windows; a smaller stride gives sliding windows where each window scores only its last ``stride``
targets (those not scored before), every one of them with at least ``seq_length - stride`` tokens of
context (the first window scores all of its targets).

Frequency stratification (the paper's analysis): each target token is put in a bucket by its
relative frequency in the training data, ``counts[id] / counts.sum()`` with ``counts`` the
``*_token_counts.npy`` of the preprocessing tool. Edges ``e1 < e2 < ...`` give the buckets
``f < e1``, ``e1 <= f < e2``, ..., ``f >= e_last``; ids that never occur in training (and ids past
the end of ``counts``, e.g. vocabulary padding) have ``f = 0``. Per bucket: tokens, mean NLL, PPL. The
evaluation keeps the summed NLL and the count per target id, so buckets are cheap to recompute with
other edges (:func:`stratify`), also from a saved ``*_per_token.npz``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megatron_lev.jsonl import expand_inputs, iter_lines

from .scorer import PROGRESS_SECONDS, Scorer, scoring_progress

PAPER_EDGES = (1e-7, 1e-6, 1e-5, 1e-4)
EXPOSURE_BUCKETS = (("never", 0, 0), ("1-10", 1, 10), ("11-100", 11, 100), ("101-1k", 101, 1000),
                    ("1k-10k", 1001, 10000), (">10k", 10001, None))
LN2 = math.log(2.0)


def iter_json_objects(path: str) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(line number, object) of each non-empty line of a .jsonl(.gz/.zst) file; a line that is not a
    JSON object is a :class:`DataFormatError` naming file:line."""
    for lineno, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise DataFormatError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise DataFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


class DataFormatError(ValueError):
    """An evaluation data file is malformed; the message names the file (and line)."""


# ------------------------------------------------------------------------------------------------
# document sources: iterators of (token ids, UTF-8 bytes of the document's text)


def is_indexed_prefix(path: str) -> bool:
    return os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx")


def indexed_documents(prefix: str, tokenizer=None, limit: Optional[int] = None,
                      sample_tokens: Optional[int] = None) -> Iterator[Tuple[np.ndarray, int]]:
    """Documents of a megatron indexed dataset (``prefix.bin/.idx``). Bytes come from detokenising each
    document without its trailing EOD (0 when no tokenizer is given: no bits per byte). ``sample_tokens``:
    only the documents ``spread_indices`` picks by their token counts (read from the index)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not is_indexed_prefix(prefix):
        raise DataFormatError(f"{prefix}: no {prefix}.bin / {prefix}.idx")
    ds = IndexedDataset(prefix, multimodal=False, mmap=True)
    docs = ds.document_indices
    eod = getattr(tokenizer, "eod", None)
    n_docs = len(docs) - 1
    if limit is not None:
        n_docs = min(n_docs, limit)
    chosen: Iterable[int] = range(n_docs)
    if sample_tokens is not None:
        seq_tokens = np.asarray(ds.sequence_lengths, dtype=np.int64)
        per_doc = [int(seq_tokens[int(docs[d]):int(docs[d + 1])].sum()) for d in range(n_docs)]
        chosen = spread_indices(per_doc, sample_tokens)
    for d in chosen:
        parts = [np.asarray(ds[i], dtype=np.int64) for i in range(int(docs[d]), int(docs[d + 1]))]
        toks = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        nbytes = 0
        if tokenizer is not None:
            body = toks[:-1] if (len(toks) and eod is not None and toks[-1] == eod) else toks
            nbytes = len(tokenizer.detokenize(body.tolist()).encode("utf-8"))
        yield toks, nbytes


def jsonl_documents(paths: Sequence[str], tokenizer, key: str = "text", limit: Optional[int] = None,
                    append_eod: bool = True) -> Iterator[Tuple[np.ndarray, int]]:
    """Documents of .jsonl / .jsonl.gz / .jsonl.zst files, tokenised on the fly (EOD appended; empty
    texts skipped).

    A line that is not a JSON object with a string under ``key`` is a :class:`DataFormatError`
    naming the file and line (empty lines are skipped).
    """
    for obj in _jsonl_objects(paths, key, limit):
        text = obj[key]
        ids = tokenizer.tokenize(text)
        if append_eod:
            ids = list(ids) + [tokenizer.eod]
        yield np.asarray(ids, dtype=np.int64), len(text.encode("utf-8"))


def _jsonl_objects(paths: Sequence[str], key: str, limit: Optional[int]) -> Iterator[Dict[str, Any]]:
    """The objects with a non-empty string under ``key`` (an empty one has nothing to score, and no separator:
    as if the line were absent), the first ``limit``; any other line a DataFormatError naming file:line."""
    try:
        files = expand_inputs(list(paths))
    except FileNotFoundError as e:
        raise DataFormatError(str(e)) from None
    n = 0
    for path in files:
        for lineno, obj in iter_json_objects(path):
            if limit is not None and n >= limit:
                return
            if _text(obj, key, path, lineno):
                yield obj
                n += 1


def first_document(files: Sequence[str], key: str = "text") -> Optional[Tuple[str, int]]:
    """(file, line) of the first document of jsonl ``files`` that has text to score (what
    :func:`jsonl_documents` yields first), None when there is none; a malformed line before it is a
    :class:`DataFormatError`."""
    for path in files:
        for lineno, obj in iter_json_objects(path):
            if _text(obj, key, path, lineno):
                return path, lineno
    return None


def _text(obj: Dict[str, Any], key: str, path: str, lineno: int) -> str:
    if not isinstance(obj.get(key), str):
        raise DataFormatError(f"{path}:{lineno}: expected a JSON object with a string field {key!r}")
    return obj[key]


def documents_from_path(path: str, tokenizer, key: str = "text", limit: Optional[int] = None,
                        sample_tokens: Optional[int] = None):
    """An indexed prefix (``path.bin/.idx``) or jsonl file(s) (comma-separated or a glob); ``sample_tokens``:
    documents spread evenly over the set holding about that many tokens (``spread_indices``; a jsonl set's
    are picked by their length in bytes at the bytes per token of its first documents, and only those are
    tokenised)."""
    if is_indexed_prefix(path):
        return indexed_documents(path, tokenizer, limit, sample_tokens)
    paths = [p for p in path.split(",") if p]
    if sample_tokens is None:
        return jsonl_documents(paths, tokenizer, key=key, limit=limit)
    texts = [obj[key] for obj in _jsonl_objects(paths, key, limit)]
    probe = texts[:32]
    per_byte = sum(len(tokenizer.tokenize(t)) + 1 for t in probe) / max(1, sum(len(t.encode("utf-8")) for t in probe))
    picked = spread_indices([len(t.encode("utf-8")) for t in texts], sample_tokens / max(per_byte, 1e-9))
    return [(np.asarray(list(tokenizer.tokenize(texts[i])) + [tokenizer.eod], dtype=np.int64),
             len(texts[i].encode("utf-8"))) for i in picked]


def spread_indices(lengths: Sequence[int], target: float) -> List[int]:
    """Indices of documents spread evenly over the set (the ``floor(i * n / k)``-th), with the smallest ``k``
    whose documents' ``lengths`` add up to ``target``: a subset that follows the set's make-up, where its first
    documents need not (a set is often grouped by source). All of them when the set holds less."""
    if target <= 0:
        raise ValueError(f"a sample of {target} tokens: give at least 1")
    n = len(lengths)
    if sum(lengths) <= target:
        return list(range(n))
    for k in range(1, n + 1):
        picked = [i * n // k for i in range(k)]
        if sum(lengths[i] for i in picked) >= target:
            return picked
    return list(range(n))


# ------------------------------------------------------------------------------------------------
# windows


def iter_windows(docs: Iterable[Tuple[np.ndarray, int]], seq_length: int, stride: Optional[int], eod: int,
                 max_tokens: Optional[int] = None, stats: Optional[Dict[str, int]] = None,
                 document_index: bool = False) -> Iterator[Tuple[np.ndarray, ...]]:
    """(window tokens, number of leading targets to skip) over the stream ``[eod] + doc1 + doc2 ...``;
    with ``document_index`` a third element, the document (0, 1, ... in stream order) of each window token
    (a document's trailing EOD is its own; the leading EOD, never a target, is -1).

    A window holds up to ``seq_length + 1`` tokens; its targets are tokens ``1..``; the first
    ``skip`` of them were scored by an earlier window. ``max_tokens`` stops adding documents once
    the stream holds that many targets (whole documents only). ``stats`` receives documents/bytes.
    """
    stride = stride or seq_length
    if not 1 <= stride <= seq_length:
        raise ValueError(f"stride must be in [1, seq_length={seq_length}] (got {stride})")
    stats = stats if stats is not None else {}
    stats.setdefault("documents", 0)
    stats.setdefault("bytes", 0)
    buf = np.asarray([eod], dtype=np.int64)  # stream tokens from absolute position `base`
    dbuf = np.asarray([-1], dtype=np.int64)  # their documents
    base = 0
    start = 0  # absolute start of the next window
    scored_until = 0  # absolute index of the last scored target (targets are 1..)
    total = 1
    docs_it = iter(docs)
    exhausted = False
    while True:
        while not exhausted and total < start + seq_length + 1:
            if max_tokens is not None and total - 1 >= max_tokens:
                exhausted = True
                break
            try:
                toks, nbytes = next(docs_it)
            except StopIteration:
                exhausted = True
                break
            if len(toks) == 0:
                continue
            stats["documents"] += 1
            stats["bytes"] += int(nbytes)
            buf = np.concatenate([buf[start - base:], toks])
            dbuf = np.concatenate([dbuf[start - base:], np.full(len(toks), stats["documents"] - 1, dtype=np.int64)])
            base = start
            total += len(toks)
        end = min(start + seq_length + 1, total)
        if end - start < 2 or end - 1 <= scored_until:
            return
        window = buf[start - base:end - base]
        skip = max(0, scored_until - start)
        yield (window, skip, dbuf[start - base:end - base]) if document_index else (window, skip)
        scored_until = end - 1
        if end == total and exhausted:
            return
        start += stride


# ------------------------------------------------------------------------------------------------
# results


@dataclass
class PerplexityResult:
    name: str
    source: str
    tokens: int
    documents: int
    bytes: int
    nll_sum: float
    seq_length: int
    stride: int
    nll_by_id: np.ndarray = field(repr=False)  # float64 [V]: summed NLL per target id
    count_by_id: np.ndarray = field(repr=False)  # int64 [V]: occurrences per target id
    nll_by_doc: Optional[np.ndarray] = field(default=None, repr=False)  # float64 [documents]: summed NLL
    tokens_by_doc: Optional[np.ndarray] = field(default=None, repr=False)  # int64 [documents]: targets scored

    @property
    def nll(self) -> float:
        return self.nll_sum / max(self.tokens, 1)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.nll, 700.0))

    @property
    def bits_per_byte(self) -> Optional[float]:
        return self.nll_sum / LN2 / self.bytes if self.bytes else None

    def to_dict(self) -> Dict[str, Any]:
        return {"source": self.source, "tokens": self.tokens, "documents": self.documents, "bytes": self.bytes,
                "nll": self.nll, "ppl": self.ppl, "bits_per_byte": self.bits_per_byte,
                "seq_length": self.seq_length, "stride": self.stride}

    def save_per_token(self, path: str) -> None:
        from .report import atomic_path

        with atomic_path(path) as tmp:  # ends in .npz: numpy keeps the name
            per_doc = {} if self.nll_by_doc is None else {"nll_by_doc": self.nll_by_doc, "tokens_by_doc": self.tokens_by_doc}
            np.savez_compressed(tmp, nll_by_id=self.nll_by_id, count_by_id=self.count_by_id, **per_doc)


def evaluate_perplexity(scorer: Scorer, docs: Iterable[Tuple[np.ndarray, int]], *, eod: int, name: str = "ppl",
                        source: str = "", seq_length: Optional[int] = None, stride: Optional[int] = None,
                        max_tokens: Optional[int] = None, progress: bool = True, chunk_windows: int = 256,
                        vocab_size: Optional[int] = None, progress_seconds: float = PROGRESS_SECONDS
                        ) -> PerplexityResult:
    """Perplexity of ``scorer`` over the document stream (see the module docstring); with ``progress``, the
    windows scored are shown as they go (a line every ``progress_seconds`` when stderr is not a terminal)."""
    seq_length = int(seq_length or scorer.max_length)
    if seq_length > scorer.max_length:
        raise ValueError(f"seq_length {seq_length} is longer than the model's {scorer.max_length}")
    stride = int(stride or seq_length)
    V = int(vocab_size or scorer.vocab_size)
    nll_by_id = np.zeros(V, dtype=np.float64)
    count_by_id = np.zeros(V, dtype=np.int64)
    stats: Dict[str, int] = {}
    nll_sum = 0.0
    tokens = 0
    nll_by_doc = np.zeros(0, dtype=np.float64)
    tokens_by_doc = np.zeros(0, dtype=np.int64)
    windows = iter_windows(docs, seq_length, stride, eod, max_tokens, stats, document_index=True)
    shown = scoring_progress(scorer, name, unit="window", enabled=progress, seconds=progress_seconds)
    for chunk in _chunks(windows, chunk_windows):
        scores = scorer.score([w for w, _, _ in chunk], progress=shown)
        for (w, skip, doc), sc in zip(chunk, scores):
            tgt = w[1 + skip:]
            nll = -sc.logprobs[skip:]
            tdoc = doc[1 + skip:]  # targets are never the leading EOD: every one has a document
            if tdoc.size:
                top = int(tdoc.max()) + 1
                if top > nll_by_doc.size:
                    nll_by_doc = np.concatenate([nll_by_doc, np.zeros(top - nll_by_doc.size)])
                    tokens_by_doc = np.concatenate([tokens_by_doc, np.zeros(top - tokens_by_doc.size, dtype=np.int64)])
                nll_by_doc[:top] += np.bincount(tdoc, weights=nll, minlength=top)
                tokens_by_doc[:top] += np.bincount(tdoc, minlength=top)
            if tgt.size and tgt.max() >= V:
                grow = int(tgt.max()) + 1
                nll_by_id = np.concatenate([nll_by_id, np.zeros(grow - V)])
                count_by_id = np.concatenate([count_by_id, np.zeros(grow - V, dtype=np.int64)])
                V = grow
            np.add.at(nll_by_id, tgt, nll)
            np.add.at(count_by_id, tgt, 1)
            nll_sum += float(nll.sum())
            tokens += int(tgt.size)
    shown.close()
    if tokens == 0:  # a mean over nothing: PPL 1.0 would read as a perfect score
        raise DataFormatError(f"{source or name}: 0 tokens to score (no document with text); nothing to evaluate")
    return PerplexityResult(name=name, source=source, tokens=tokens, documents=stats.get("documents", 0),
                            bytes=stats.get("bytes", 0), nll_sum=nll_sum, seq_length=seq_length, stride=stride,
                            nll_by_id=nll_by_id, count_by_id=count_by_id,
                            nll_by_doc=nll_by_doc, tokens_by_doc=tokens_by_doc)


def _chunks(it: Iterable, n: int) -> Iterator[List]:
    chunk: List = []
    for x in it:
        chunk.append(x)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ------------------------------------------------------------------------------------------------
# frequency stratification


def parse_edges(text: Optional[str]) -> Tuple[float, ...]:
    """``"1e-7,1e-6,1e-5,1e-4"`` -> increasing floats (None/"" -> the paper's edges)."""
    if not text:
        return PAPER_EDGES
    try:
        edges = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"bucket edges {text!r}: expected comma-separated numbers like 1e-7,1e-6") from None
    if not edges or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] <= 0:
        raise ValueError(f"bucket edges {text!r}: expected positive, strictly increasing numbers")
    return edges


def bucket_labels(edges: Sequence[float]) -> List[str]:
    f = lambda x: f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e+")  # noqa: E731
    labels = [f"< {f(edges[0])}"]
    labels += [f"{f(a)} – {f(b)}" for a, b in zip(edges, edges[1:])]
    labels.append(f"≥ {f(edges[-1])}")
    return labels


def relative_frequencies(token_counts: np.ndarray, size: int) -> np.ndarray:
    counts = np.asarray(token_counts, dtype=np.float64).reshape(-1)
    total = counts.sum()
    if total <= 0:
        raise ValueError("the token counts are all zero")
    freq = np.zeros(size, dtype=np.float64)
    n = min(size, counts.size)
    freq[:n] = counts[:n] / total
    return freq


def load_token_counts(path: str) -> np.ndarray:
    try:
        counts = np.load(path)
    except (OSError, ValueError) as e:
        raise DataFormatError(f"{path}: cannot read token counts ({e})") from None
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.number):
        raise DataFormatError(f"{path}: expected a 1-D array of counts per token id, got shape {counts.shape}")
    return counts


def stratify(nll_by_id: np.ndarray, count_by_id: np.ndarray, token_counts: np.ndarray,
             edges: Sequence[float] = PAPER_EDGES) -> List[Dict[str, Any]]:
    """Per-bucket tokens / mean NLL / PPL (buckets partition every scored token)."""
    edges = tuple(edges)
    freq = relative_frequencies(token_counts, len(count_by_id))
    bucket = np.searchsorted(np.asarray(edges), freq, side="right")  # 0 .. len(edges)
    out = []
    for b, label in enumerate(bucket_labels(edges)):
        sel = bucket == b
        n = int(count_by_id[sel].sum())
        s = float(nll_by_id[sel].sum())
        nll = s / n if n else None
        out.append({"bucket": label, "lo": edges[b - 1] if b > 0 else 0.0,
                    "hi": edges[b] if b < len(edges) else None, "tokens": n, "vocab_ids": int((sel & (count_by_id > 0)).sum()),
                    "nll": nll, "ppl": math.exp(min(nll, 700.0)) if nll is not None else None})
    return out


def stratify_by_exposure(nll_by_id: np.ndarray, count_by_id: np.ndarray, token_counts: np.ndarray,
                         scale: float = 1.0) -> List[Dict[str, Any]]:
    """Per-bucket tokens / mean NLL / PPL by how often the target id was trained on: its training count
    times ``scale`` (the fraction of the counted set a run trained on; 1: the count as it is), rounded;
    buckets ``EXPOSURE_BUCKETS`` (never, 1-10, ..., >10k). Where the relative-frequency buckets depend on
    the size of the training set, these say how many times the model saw the token."""
    if scale < 0:
        raise ValueError(f"exposure scale {scale}: expected a fraction >= 0")
    counts = np.zeros(len(count_by_id), dtype=np.float64)
    given = np.asarray(token_counts, dtype=np.float64).reshape(-1)
    n = min(len(counts), given.size)
    counts[:n] = given[:n]
    seen = np.rint(counts * scale)
    out = []
    for label, lo, hi in EXPOSURE_BUCKETS:
        sel = (seen >= lo) & (seen <= (np.inf if hi is None else hi))
        k = int(count_by_id[sel].sum())
        nll = float(nll_by_id[sel].sum()) / k if k else None
        out.append({"bucket": label, "lo": lo, "hi": hi, "tokens": k, "vocab_ids": int((sel & (count_by_id > 0)).sum()),
                    "nll": nll, "ppl": math.exp(min(nll, 700.0)) if nll is not None else None})
    return out
