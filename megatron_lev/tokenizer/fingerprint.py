"""Tokenizer fingerprints: what a dataset or a checkpoint was made with, compared where it is used.

A fingerprint is a small dict ``{"type", "vocab_size", "files", "sha256"}``: the tokenizer's class,
its vocabulary size, the names of its files and a hash of their bytes together with the options
that change the ids (TikToken pattern, EOD token). Preprocessing writes it beside every ``.bin/.idx``
(``{prefix}.tokenizer.json``); training saves it with every checkpoint (``tokenizer_fingerprint``
in the saved arguments) and export-hf beside the exported tokenizer files (:data:`MODEL_DIR_SIDECAR`);
resuming, training on a dataset and evaluating a checkpoint or a Hugging Face model compare it with
the tokenizer of the run (:func:`tokenizer_mismatch`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Dict, List, Optional, Set

ALLOW_FLAG = "--allow-tokenizer-mismatch"


def fingerprint(tokenizer) -> Dict[str, Any]:
    """The fingerprint of a built :class:`~megatron_lev.tokenizer.LevTokenizer`."""
    ids = dict(getattr(tokenizer, "unique_identifiers", {}) or {})
    paths = list(ids.pop("tokenizer_path", []) or [])
    kind = str(ids.pop("class", type(tokenizer).__name__))
    h = hashlib.sha256()
    h.update(json.dumps(ids, sort_keys=True).encode())
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    own = {"type": kind, "vocab_size": int(tokenizer.vocab_size), "files": [os.path.basename(p) for p in paths],
           "sha256": h.hexdigest()}
    return _recorded_identity(paths, own)


FILES_RECORDED = "these_files"
"""The key of a :data:`MODEL_DIR_SIDECAR` under which ``import-hf`` lists the fingerprints of the tokenizer
files beside it: tokenizers built from those files are the recorded tokenizer."""


def _recorded_identity(paths: List[str], own: Dict[str, Any]) -> Dict[str, Any]:
    """The tokenizer recorded beside ``paths`` when the record names these very files (their fingerprint
    ``own``), else ``own``. A Hugging Face export writes its checkpoint's tokenizer in HF form, whose files
    hash differently; ``import-hf`` keeps the export's record with theirs, so that the imported checkpoint
    is still the tokenizer its datasets were made with."""
    folders = {os.path.dirname(os.path.abspath(p)) for p in paths}
    if len(folders) != 1:
        return own
    try:
        recorded = read_sidecar(os.path.join(folders.pop(), MODEL_DIR_SIDECAR))
    except ValueError:
        return own  # a damaged record stands for nothing
    if recorded is None or not any(same_tokenizer(own, fp) for fp in recorded.get(FILES_RECORDED) or []):
        return own
    return {k: v for k, v in recorded.items() if k != FILES_RECORDED}


def describe(fp: Optional[Dict[str, Any]]) -> str:
    """``GPT2BPETokenizer (50257 ids, vocab.json+merges.txt sha256 1a2b3c4d5e6f)``."""
    if not fp:
        return "an unrecorded tokenizer"
    files = "+".join(fp.get("files") or [])
    return (f"{fp.get('type')} ({fp.get('vocab_size')} ids, {files + ' ' if files else ''}"
            f"sha256 {str(fp.get('sha256', ''))[:12]})")


def same_tokenizer(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return (a.get("type"), a.get("vocab_size"), a.get("sha256")) == (b.get("type"), b.get("vocab_size"), b.get("sha256"))


def tokenizer_mismatch(recorded: Optional[Dict[str, Any]], current: Optional[Dict[str, Any]], where: str,
                       made: str = "made") -> Optional[str]:
    """One line when ``recorded`` (of ``where``) and ``current`` differ, else None (also when either is unknown)."""
    if not recorded or not current or same_tokenizer(recorded, current):
        return None
    return (f"{where} was {made} with {describe(recorded)} but this run's tokenizer is {describe(current)}; "
            f"give the same tokenizer files, or pass {ALLOW_FLAG} if this is deliberate")


MODEL_DIR_SIDECAR = "tokenizer_fingerprint.json"
"""A Hugging Face export's record of its checkpoint's tokenizer fingerprint (beside tokenizer.json)."""


def directory_fingerprints(path: str) -> List[Dict[str, Any]]:
    """The fingerprints a Hugging Face model directory's tokenizer can have.

    The one an export recorded (:data:`MODEL_DIR_SIDECAR`) when it is there; else one per tokenizer
    format whose files the directory holds (``tokenizer.json``; ``vocab.json`` + ``merges.txt``;
    ``tokenizer.model``), as preprocessing with that format would have recorded it. Files that do
    not build are left out; an empty list means nothing could be fingerprinted."""
    from .tokenizers import build_tokenizer

    recorded = read_sidecar(os.path.join(path, MODEL_DIR_SIDECAR))
    if recorded is not None:
        return [recorded]
    files = {n: os.path.join(path, n) for n in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")}
    have = {n for n, p in files.items() if os.path.isfile(p)}
    candidates = []
    if "tokenizer.json" in have:
        candidates.append(dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files["tokenizer.json"]))
    if {"vocab.json", "merges.txt"} <= have:
        candidates.append(dict(tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab.json"],
                               merge_file=files["merges.txt"]))
    if "tokenizer.model" in have:
        candidates.append(dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=files["tokenizer.model"]))
    fps = []
    for kw in candidates:
        try:
            fps.append(fingerprint(build_tokenizer(**kw)))
        except Exception:  # a file of another flavour (e.g. a tokenizer.model that is not SentencePiece)
            continue
    return fps


def sidecar_path(ds_prefix: str) -> str:
    """``{prefix}.tokenizer.json``: the fingerprint of the tokenizer a ``.bin/.idx`` pair was made with."""
    return ds_prefix + ".tokenizer.json"


def write_sidecar(path: str, fp: Dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fp, f, indent=1, sort_keys=True)
        f.write("\n")


def read_sidecar(path: str) -> Optional[Dict[str, Any]]:
    """The fingerprint in ``path``; None when there is none. A damaged file raises ValueError naming it."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable tokenizer fingerprint ({e}); preprocess the data again") from None
    if not isinstance(data, dict) or "sha256" not in data:
        raise ValueError(f"{path}: not a tokenizer fingerprint; preprocess the data again")
    return data


def check_dataset_tokenizer(prefix: str, current: Optional[Dict[str, Any]], *, allow_mismatch: bool = False,
                            warn: Callable[[str], None] = print, warned: Optional[Set[str]] = None) -> None:
    """Compare the fingerprint beside the dataset ``prefix`` with ``current`` (the run's tokenizer).

    A mismatch raises ValueError (one line naming both tokenizers) unless ``allow_mismatch``, which
    warns instead; so does a damaged fingerprint file. A dataset made before fingerprints were
    written warns (once per prefix when a ``warned`` set is kept across calls).
    """
    if current is None:
        return
    path = sidecar_path(prefix)
    recorded = read_sidecar(path)
    if recorded is None:
        if warned is None or prefix not in warned:
            if warned is not None:
                warned.add(prefix)
            warn(f"WARNING: {prefix}: no {os.path.basename(path)} (preprocessed before tokenizer fingerprints "
                 "were recorded); its tokenizer cannot be checked against this run's")
        return
    msg = tokenizer_mismatch(recorded, current, f"{prefix}.bin", made="preprocessed")
    if msg is None:
        return
    if not allow_mismatch:
        raise ValueError(msg)
    warn(f"WARNING: {msg.split('; give the same')[0]} (allowed by {ALLOW_FLAG})")
