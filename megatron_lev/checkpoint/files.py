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
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from megatron_lev.compat.versions import checkpoint_refusal, unreadable_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"
CONFIG_NAME = "config.yaml"
# Saved arguments that fix the model's tensors: a resumed run and a config.yaml must agree on them.
STRUCTURE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "input_embedding", "padded_vocab_size", "normalization", "swiglu", "position_embedding_type",
    "disable_bias_linear", "rotary_percent", "lev_digits", "lev_base", "lev_seed_dim", "lev_knots", "lev_rank",
    "lev_heads", "albert_dim", "flat_mlp_dim", "mlp_hidden",
)
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, incompatible); one-line message."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """Iteration named by the tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "r", encoding="utf-8") as f:
        text = f.read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


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


def find_checkpoint(root: str) -> Optional[Tuple[int, str]]:
    """(iteration, directory) of the newest complete checkpoint under ``root``, or None."""
    it = read_tracker(root)
    if it is None:
        return None
    path = checkpoint_dir(root, it)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"{path}: named by {os.path.join(root, TRACKER)} but incomplete (no metadata.json)")
    return it, path


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


def load_common(path: str) -> Dict[str, Any]:
    """The non-sharded part of a dist_checkpointing directory (``common.pt``)."""
    from megatron.core import dist_checkpointing

    refusal = unreadable_checkpoint(str(path))
    if refusal:
        raise CheckpointError(refusal)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:  # corrupt or foreign directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable dist_checkpointing checkpoint ({first})") from None
    refusal = checkpoint_refusal(common.get("megatron_core_version"), str(path))
    if refusal:
        raise CheckpointError(refusal)
    return common


def _locate(path: str, iteration: Optional[int]) -> Tuple[str, int, str]:
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
        it = read_tracker(path)
        if it is None:
            found = sorted(d for d in os.listdir(path) if _ITER_DIR.match(d))
            hint = f"; found {', '.join(found[-3:])}: pass --iteration N to choose one" if found else ""
            raise CheckpointError(f"{path}: no {TRACKER} (not a checkpoint root, or no save completed){hint}")
    else:
        it = int(iteration)
    iter_path = checkpoint_dir(path, it)
    if not os.path.isdir(iter_path):
        raise CheckpointError(f"{iter_path}: no such checkpoint (iteration {it})")
    return path, it, iter_path


def open_checkpoint(path: str, iteration: Optional[int] = None, *, read_common: bool = True) -> SavedCheckpoint:
    """Locate and check the checkpoint at ``path`` (a root with a tracker file, or an ``iter_*`` dir)."""
    root, it, iter_path = _locate(path, iteration)
    if not os.path.isfile(os.path.join(iter_path, "metadata.json")):
        raise CheckpointError(f"{iter_path}: incomplete checkpoint (no metadata.json)")
    cfg_path = os.path.join(iter_path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{iter_path}: no {CONFIG_NAME} (the save did not complete)")
    cfg = _read_yaml(cfg_path)
    common: Dict[str, Any] = {}
    args = dict(cfg)
    if read_common:
        common = load_common(iter_path)
        saved = common.get("args")
        if isinstance(saved, dict) and saved:
            for key in STRUCTURE_ARGS:
                if key in saved and key in cfg and saved[key] != cfg[key]:
                    raise CheckpointError(
                        f"{cfg_path}: {key} is {cfg[key]!r} but the checkpoint was saved with {saved[key]!r} "
                        f"(config.yaml does not belong to this checkpoint)")
            args = dict(saved)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "input_embedding", "padded_vocab_size"):
        if args.get(key) is None:
            raise CheckpointError(f"{cfg_path}: the saved configuration has no {key}")
    return SavedCheckpoint(root=root, iteration=int(it), path=iter_path, args=args, common=common)
