"""Checkpoint directories: the tracker file, ``iter_*`` directories, and the saved arguments.

A checkpoint root (training's ``--save``) holds ``latest_checkpointed_iteration.txt`` (written last by
the saver, naming the newest complete checkpoint) and ``iter_XXXXXXX/`` dist_checkpointing directories
with ``config.yaml`` (the resolved training arguments) beside the shards. ``open_checkpoint`` accepts
the root (the tracker's iteration, or ``iteration``) or an ``iter_*`` directory, checks that the
checkpoint is complete and that ``config.yaml`` agrees with the arguments stored inside it, and returns
a :class:`SavedCheckpoint`. Every problem is a :class:`CheckpointError` with a one-line message.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_lev.tokenizer import ALLOW_TOKENIZER_MISMATCH_FLAG, tokenizer_mismatch

from megatron_lev.compat.versions import checkpoint_refusal, unreadable_checkpoint
from megatron_lev.models.arms import arm_settings

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG_NAME = "config.yaml"
# Saved arguments that fix the model's tensors: a resumed run and a config.yaml must agree on them (with the
# input arms' settings, models.arms).
STRUCTURE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "input_embedding", "padded_vocab_size", "normalization", "swiglu", "position_embedding_type",
    "disable_bias_linear", "rotary_percent", "lev_digits", "lev_base", "lev_seed_dim", "lev_knots", "lev_rank",
    "lev_heads", *arm_settings(), "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
    "mtp_num_layers", "max_position_embeddings",
)
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, incompatible); one-line message."""


def check_checkpoint_tokenizer(saved_args: Dict[str, Any], tokenizer_fp: Optional[Dict[str, Any]],
                               tokenizer_type: Optional[str], path: str, *, allow_mismatch: bool = False,
                               log=print) -> None:
    """Refuse a checkpoint saved with another tokenizer than ``tokenizer_fp`` (one line naming both).

    ``allow_mismatch`` warns instead. A checkpoint saved before fingerprints were recorded is
    compared by tokenizer type only (and a warning says so).
    """
    recorded = saved_args.get("tokenizer_fingerprint")
    if recorded:
        msg = tokenizer_mismatch(recorded, tokenizer_fp, path, made="saved")
    elif saved_args.get("tokenizer_type") and tokenizer_type and saved_args["tokenizer_type"] != tokenizer_type:
        msg = (f"{path} was saved with --tokenizer-type {saved_args['tokenizer_type']} but this run's tokenizer is "
               f"{tokenizer_type}; give the same tokenizer, or pass {ALLOW_TOKENIZER_MISMATCH_FLAG} if this is "
               "deliberate")
    else:
        if tokenizer_fp is not None:
            log(f"WARNING: {path}: saved without a tokenizer fingerprint; only its tokenizer type is checked")
        return
    if msg is None:
        return
    if allow_mismatch:
        log(f"WARNING: {msg.split('; give the same')[0]} (allowed by {ALLOW_TOKENIZER_MISMATCH_FLAG})")
        return
    raise CheckpointError(msg)


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str, older_hint: Optional[Callable[[int, str], str]] = None) -> Optional[int]:
    """Iteration named by the tracker file, or None when there is none.

    An empty tracker, or one that holds no iteration number (text, a negative number), is a
    :class:`CheckpointError` naming the file; with ``older_hint`` the message adds the newest complete
    checkpoint under ``root`` and ``older_hint(iteration, directory)``, the way to load it."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        text = f.read().strip()
    if text == "release":
        return 0
    try:
        it = int(text)
    except ValueError:
        it = None
    if it is not None and it >= 0:
        return it
    what = "empty" if not text else f"holds {text!r}, not an iteration number"
    raise CheckpointError(f"{path}: {what} (a bad tracker; nothing was loaded){_newest_hint(root, older_hint)}")


def _newest_hint(root: str, older_hint: Optional[Callable[[int, str], str]]) -> str:
    if older_hint is None:
        return ""
    newest = newest_complete_checkpoint(root)
    return (f"; the newest complete checkpoint there is {newest[1]}: {older_hint(*newest)}" if newest
            else f"; no complete checkpoint under {root}")


def write_tracker(root: str, iteration: int) -> None:
    """Name ``iteration`` in the tracker atomically (temporary file, fsync, ``os.replace``, fsync the dir)."""
    tmp = os.path.join(root, f".{TRACKER}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    try:
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some filesystems cannot fsync a directory; the tracker itself is already on disk
        pass


def find_checkpoint(root: str, older_hint: Optional[Callable[[int, str], str]] = None) -> Optional[Tuple[int, str]]:
    """(iteration, directory) that the tracker under ``root`` names, or None without a tracker.

    Whether its files are all there is :func:`check_intact`'s question (a missing ``metadata.json`` is
    reported like any damaged file, with the newest complete older checkpoint)."""
    it = read_tracker(root, older_hint)
    if it is None:
        return None
    return it, checkpoint_dir(root, it)


def looks_like_one_checkpoint(path: str) -> bool:
    """``path`` is one ``iter_*`` dist_checkpointing directory (not a root)."""
    return any(os.path.exists(os.path.join(path, n)) for n in ("metadata.json", "common.pt", ".metadata"))


@dataclass
class SavedCheckpoint:
    root: str
    """Directory holding the tracker (the parent of ``path``)."""
    iteration: int
    path: str
    """The ``iter_XXXXXXX`` dist_checkpointing directory."""
    args: Dict[str, Any]
    """The resolved training arguments saved in the checkpoint (also ``config.yaml``)."""
    common: Dict[str, Any] = field(default_factory=dict, repr=False)
    """The checkpoint's non-sharded state (iteration, consumed samples, counters, scheduler, layout)."""

    @property
    def layout(self) -> Dict[str, int]:
        lay = self.common.get("layout") or {}
        return {"tp": int(lay.get("tp", self.args.get("tensor_model_parallel_size", 1))),
                "pp": int(lay.get("pp", self.args.get("pipeline_model_parallel_size", 1))),
                "world_size": int(lay.get("world_size", self.args.get("world_size", 1)))}


def _read_yaml(path: str) -> Dict[str, Any]:
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot read the saved configuration ({first})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a mapping of argument names to values")
    return data


def find_damage(path: str) -> Optional[Tuple[str, str]]:
    """(file, what is wrong) for the first damaged file of the dist_checkpointing directory ``path``, else None.

    Checks that the folder, ``metadata.json`` and ``config.yaml`` (written by rank 0 once every rank's
    shards are on disk) exist, that ``.metadata`` reads, that every shard file it names exists and is as
    long as the byte ranges it records there, and that ``common.pt`` reads (where the layout has one).
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isdir(path):
        return path, "missing"
    for name in ("metadata.json", CONFIG_NAME):
        if not os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name), "missing"
    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        return meta, "missing"
    try:
        metadata = FileSystemReader(path).read_metadata()
        ends: Dict[str, int] = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as e:  # a truncated or foreign pickle
        return meta, f"unreadable ({_first_line(e)})"
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            return shard, "missing"
        size = os.path.getsize(shard)
        if size < end:
            return shard, f"truncated ({size:,} of {end:,} bytes)"
    common = os.path.join(path, "common.pt")
    if not os.path.isfile(common):
        # megatron-core >= 0.19 keeps the common state as a "common_state" object inside the torch_dist
        # files (checked above) and writes no common.pt; a release that cannot read that layout refuses
        # it in one line when the common state is loaded.
        if any(str(k).startswith("common_state") for k in getattr(metadata, "state_dict_metadata", {})):
            return None
        return common, "missing"
    try:
        torch.load(common, map_location="cpu", weights_only=False)
    except Exception as e:
        return common, f"unreadable ({_first_line(e)})"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _wrapped(error: BaseException) -> List[BaseException]:
    """The errors ``error`` carries in its arguments: torch's CheckpointException holds each rank's as
    (exception, traceback) in a dict."""
    found: List[BaseException] = []
    for v in (getattr(error, "args", ()) or ()):
        for x in (v.values() if isinstance(v, dict) else [v]):
            found += [y for y in (x if isinstance(x, tuple) else (x,)) if isinstance(y, BaseException)]
    return found


def raise_stop_inside(error: BaseException) -> None:
    """Raise again the Ctrl-C or SIGTERM (``KeyboardInterrupt``, ``SystemExit``: the loop's ``Terminated`` with its
    exit code) that torch's CheckpointException ``error`` wraps, if it wraps one."""
    stop = next((x for x in _wrapped(error) if isinstance(x, (KeyboardInterrupt, SystemExit))), None)
    if stop is not None:
        raise stop from None


def _failure_reason(error: BaseException) -> str:
    """The first line of the error under torch's CheckpointException wrapping (which names only ranks)."""
    inner = _wrapped(error)
    return _first_line(inner[0] if inner and type(error).__name__ == "CheckpointException" else error)


ALLOW_MISSING_CHECKSUMS_FLAG = "--allow-missing-ckpt-checksums"


def written_with_checksums(common: Dict[str, Any]) -> Optional[bool]:
    """Whether the save of the common state ``common`` recorded ``checksums.json``; None for a checkpoint that
    does not say (an older release's). Saves record it as ``checksums``; before that, the saved arguments'
    ``no_ckpt_checksums`` (added with the checksums) tells."""
    if "checksums" in common:
        return bool(common["checksums"])
    args = common.get("args")
    if isinstance(args, dict) and "no_ckpt_checksums" in args:
        return not args["no_ckpt_checksums"]
    return None


def missing_manifest(path: str, common: Dict[str, Any], allow: bool,
                     warn: Callable[[str], None]) -> Optional[Tuple[str, str]]:
    """A checkpoint ``path`` without ``checksums.json``: (file, what is wrong) when its own metadata says the
    save wrote one (deleting it must not turn the verification off), unless ``allow``; else one ``warn``
    line, None."""
    from . import checksums

    manifest_file = os.path.join(path, checksums.MANIFEST)
    if not written_with_checksums(common):
        warn(checksums.no_manifest_warning(path))
        return None
    if allow:
        warn(f"WARNING: {manifest_file}: missing, though the save recorded checksums; its files are checked for "
             f"size only ({ALLOW_MISSING_CHECKSUMS_FLAG})")
        return None
    return manifest_file, (f"missing, though the save recorded checksums (its saved metadata says so): its files "
                           f"cannot be verified; pass {ALLOW_MISSING_CHECKSUMS_FLAG} to load it checked for size "
                           "only")


def _yaml_form(value: Any) -> Any:
    """``value`` as config.yaml holds it after a round trip (tuples are lists there)."""
    import yaml

    return yaml.safe_load(yaml.safe_dump(value))


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)  # NaN is NaN


def config_mismatch(cfg_path: str, cfg: Dict[str, Any], saved: Any) -> Optional[str]:
    """One line naming the keys where ``config.yaml`` (``cfg``, read from ``cfg_path``) differs from the
    arguments the checkpoint saved in its common state (``saved``), or None when they agree (or none were
    saved)."""
    if not isinstance(saved, dict) or not saved:
        return None
    saved = _yaml_form(dict(saved))
    missing = object()
    keys = [k for k in sorted(set(cfg) | set(saved), key=str)
            if not _same(cfg.get(k, missing), saved.get(k, missing))]
    if not keys:
        return None

    def value(d, k):
        return repr(d[k]) if k in d else "absent"

    said = ", ".join(f"{k} ({value(cfg, k)} there, {value(saved, k)} saved)" for k in keys[:4])
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return (f"{cfg_path}: differs from the arguments saved in the checkpoint in {said}{more}; config.yaml was "
            "edited after the save or belongs to another checkpoint: restore it (nothing was loaded)")


def config_change(path: str) -> Optional[str]:
    """What is wrong with ``path``'s config.yaml in words naming the keys it changed against the saved
    arguments (for a checksum mismatch of config.yaml), or None when that cannot be said."""
    try:
        msg = config_mismatch(os.path.join(path, CONFIG_NAME), _read_yaml(os.path.join(path, CONFIG_NAME)),
                              load_common(path).get("args"))
    except CheckpointError:
        return None
    return None if msg is None else msg.split(": ", 1)[1].split("; config.yaml was")[0] + " (edited after the save)"


def describe_damage(path: str, manifest, index: int, kind: int) -> Tuple[str, str]:
    """(file, what is wrong) for checksum damage ``(index, kind)``; a changed config.yaml names its keys."""
    from . import checksums

    file, what = checksums.describe(path, manifest, index, kind)
    if os.path.basename(file) == CONFIG_NAME and kind in (checksums.WRONG_SIZE, checksums.WRONG_SUM):
        what = config_change(path) or what
    return file, what


def complete_iterations(root: str) -> List[int]:
    """Iterations under ``root`` whose save completed (``metadata.json`` and ``config.yaml`` written, the
    save's last files), newest first; whether their other files are intact is :func:`find_damage`'s."""
    if not os.path.isdir(root):
        return []
    found = sorted((int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m), reverse=True)
    return [it for it in found
            if all(os.path.isfile(os.path.join(checkpoint_dir(root, it), n)) for n in ("metadata.json", CONFIG_NAME))]


def older_complete_checkpoint(root: str, iteration: int) -> Optional[Tuple[int, str]]:
    """(iteration, directory) of the newest checkpoint under ``root`` older than ``iteration`` that is
    complete (metadata.json and config.yaml written) and undamaged (:func:`find_damage`)."""
    for it in complete_iterations(root):
        if it < iteration and find_damage(checkpoint_dir(root, it)) is None:
            return it, checkpoint_dir(root, it)
    return None


def newest_complete_checkpoint(root: str) -> Optional[Tuple[int, str]]:
    """(iteration, directory) of the newest complete, undamaged checkpoint under ``root``, whatever the
    tracker says."""
    return older_complete_checkpoint(root, sys.maxsize)


def iteration_hint(it: int, path: str) -> str:
    """How a conversion loads an older checkpoint."""
    return f"pass --iteration {it}"


def damaged_checkpoint_message(root: str, iteration: int, path: str, file: str, what: str,
                               older_hint: Callable[[int, str], str] = iteration_hint) -> str:
    """One line: the damaged file, the newest complete older checkpoint and how to load it."""
    older = older_complete_checkpoint(root, iteration)
    way = (f"the newest complete older checkpoint is {older[1]}: {older_hint(*older)}" if older
           else f"no complete older checkpoint under {root}")
    return f"{file}: {what}; checkpoint {path} cannot be loaded (nothing was loaded); {way}"


# Checksum verdicts of this process, by directory and the (name, size, mtime) of its files: evaluation
# opens a checkpoint more than once, and reading it whole each time would be wasted.
_VERIFIED: Dict[Tuple, Optional[Tuple[str, str]]] = {}


def _listing_key(path: str) -> Tuple:
    with os.scandir(path) as entries:
        stats = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())
    return (os.path.abspath(path), tuple(stats))


def checksum_damage(path: str, warn: Callable[[str], None], *,
                    allow_missing: bool = False) -> Optional[Tuple[str, str]]:
    """(file, what is wrong) for the first file of ``path`` that differs from its ``checksums.json``
    (every file read in this process), else None. No manifest: :func:`missing_manifest` (refused where the
    save recorded one, unless ``allow_missing``; else one ``warn`` line)."""
    from . import checksums

    manifest_file = os.path.join(path, checksums.MANIFEST)
    key = _listing_key(path)
    if not os.path.isfile(manifest_file):
        if key in _VERIFIED:  # accepted once (verified with its ranks: mark_verified): one warning at most
            return _VERIFIED[key]
        found = missing_manifest(path, load_common(path), allow_missing, warn)
        if found is None:
            _VERIFIED[key] = None
        return found
    if key not in _VERIFIED:
        try:
            manifest = checksums.read_manifest(path)
        except checksums.ManifestError as e:
            return manifest_file, str(e)
        found = checksums.first_damage(path, manifest or {})
        _VERIFIED[key] = None if found is None else describe_damage(path, manifest, *found)
    return _VERIFIED[key]


def mark_verified(path: str) -> None:
    """Record that ``path`` was just verified against its manifest (by every rank together,
    ``sharded.verify_checksums``): a later :func:`check_intact` in this process does not read it again."""
    _VERIFIED[_listing_key(path)] = None


def _warn_once_per_job(line: str) -> None:
    import torch.distributed as dist

    # Before the process group exists (evaluation's first checks), the launcher's RANK tells rank 0.
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(line, file=sys.stderr, flush=True)


def check_intact(root: str, iteration: int, path: str,
                 older_hint: Callable[[int, str], str] = iteration_hint, *, checksums: bool = True,
                 sizes: bool = True, allow_missing_checksums: bool = False,
                 warn: Callable[[str], None] = _warn_once_per_job) -> None:
    """Raise :class:`CheckpointError` (one line, :func:`damaged_checkpoint_message`) when a file of
    ``path`` is damaged: missing or short (:func:`find_damage`, with ``sizes``), or, with ``checksums``,
    changed since the save (:func:`checksum_damage`, which reads the whole checkpoint once in this process;
    ``allow_missing_checksums``: its manifest may be missing)."""
    damage = find_damage(path) if sizes else None
    if damage is None and checksums:
        damage = checksum_damage(path, warn, allow_missing=allow_missing_checksums)
    if damage is not None:
        raise CheckpointError(damaged_checkpoint_message(root, iteration, path, *damage, older_hint=older_hint))


def load_common(path: str) -> Dict[str, Any]:
    """The non-sharded part of a dist_checkpointing directory (``common.pt``)."""
    from megatron.core import dist_checkpointing

    refusal = unreadable_checkpoint(str(path))
    if refusal:
        raise CheckpointError(refusal)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # corrupt or foreign directory
        # megatron-core 0.19 reads the common state through torch.distributed.checkpoint, whose
        # CheckpointException (a BaseException) wraps each rank's error, a Ctrl-C or SIGTERM during the read too.
        raise_stop_inside(e)
        first = _failure_reason(e).split(": ", 1)[-1]
        raise CheckpointError(f"{path}: not a readable dist_checkpointing checkpoint ({first})") from None
    refusal = checkpoint_refusal(common.get("megatron_core_version"), str(path))
    if refusal:
        raise CheckpointError(refusal)
    return common


def _locate(path: str, iteration: Optional[int],
            older_hint: Callable[[int, str], str] = iteration_hint) -> Tuple[str, int, str]:
    """(root, iteration, iter directory) for a root with a tracker or an ``iter_*`` directory."""
    if not path:
        raise CheckpointError("no checkpoint given (--load DIR)")
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (give the checkpoint root that holds {TRACKER})")
    m = _ITER_DIR.match(os.path.basename(path))
    if m and os.path.isfile(os.path.join(path, "metadata.json")):
        it = int(m.group(1))
        if iteration is not None and iteration != it:
            raise CheckpointError(f"{path}: holds iteration {it}, not --iteration {iteration}")
        return os.path.dirname(path), it, path
    if iteration is None:
        it = read_tracker(path, older_hint)
        if it is None:
            found = any(_ITER_DIR.match(d) for d in os.listdir(path))
            hint = _newest_hint(path, older_hint) if found else ""
            raise CheckpointError(f"{path}: no {TRACKER} (not a checkpoint root, or no save completed){hint}")
    else:
        it = int(iteration)
    iter_path = checkpoint_dir(path, it)
    if not os.path.isdir(iter_path):
        raise CheckpointError(f"{iter_path}: no such checkpoint (iteration {it})")
    return path, it, iter_path


def open_checkpoint(path: str, iteration: Optional[int] = None, *, read_common: bool = True,
                    older_hint: Callable[[int, str], str] = iteration_hint,
                    allow_missing_checksums: bool = False) -> SavedCheckpoint:
    """Locate and check the checkpoint at ``path`` (a root with a tracker file, or an ``iter_*`` dir).

    With ``read_common`` its files are checked first (:func:`check_intact`: sizes, then config.yaml against
    the saved arguments, then checksums); a damaged one names the newest complete older checkpoint with
    ``older_hint(iteration, directory)``, the way to load it. ``allow_missing_checksums``: a checkpoint whose
    ``checksums.json`` is missing though its save recorded one is opened (a warning says so)."""
    root, it, iter_path = _locate(path, iteration, older_hint)
    for name in ("metadata.json", CONFIG_NAME):  # the save's last files: without them it did not complete
        if not os.path.isfile(os.path.join(iter_path, name)):
            raise CheckpointError(damaged_checkpoint_message(root, int(it), iter_path, os.path.join(iter_path, name),
                                                             "missing", older_hint))
    cfg_path = os.path.join(iter_path, CONFIG_NAME)
    cfg = _read_yaml(cfg_path)
    common: Dict[str, Any] = {}
    args = dict(cfg)
    if read_common:
        check_intact(root, int(it), iter_path, older_hint, checksums=False)
        common = load_common(iter_path)
        saved = common.get("args")
        mismatch = config_mismatch(cfg_path, cfg, saved)  # before the checksums: the keys say more than a CRC
        if mismatch:
            raise CheckpointError(mismatch)
        check_intact(root, int(it), iter_path, older_hint, sizes=False,
                     allow_missing_checksums=allow_missing_checksums)
        if isinstance(saved, dict) and saved:
            args = dict(saved)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "input_embedding", "padded_vocab_size"):
        if args.get(key) is None:
            raise CheckpointError(f"{cfg_path}: the saved configuration has no {key}")
    return SavedCheckpoint(root=root, iteration=int(it), path=iter_path, args=args, common=common)
