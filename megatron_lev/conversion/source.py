"""The checkpoint a conversion reads: directory checks, iteration, saved configuration.

A megatron-lev checkpoint root holds ``latest_checkpointed_iteration.txt`` (written last by the
saver) and ``iter_XXXXXXX/`` directories (dist_checkpointing, ``torch_dist``) with ``config.yaml``
beside the shards. ``open_checkpoint`` accepts the root (the tracker's iteration, or ``iteration``)
or an ``iter_*`` directory, checks that the checkpoint is complete and that ``config.yaml`` agrees
with the arguments stored inside the checkpoint, and returns a :class:`SourceCheckpoint`. Every
problem is a :class:`ConversionError` with a one-line message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from megatron_lev.training.checkpointing import CONFIG_NAME, TRACKER, CheckpointError, checkpoint_dir, read_tracker

# Saved arguments that fix the model's tensors (a config.yaml that disagrees on one of them does
# not describe the checkpoint beside it).
STRUCTURE_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "input_embedding", "padded_vocab_size", "normalization", "swiglu", "position_embedding_type",
    "disable_bias_linear", "rotary_percent", "lev_digits", "lev_base", "lev_seed_dim", "lev_knots", "lev_rank",
    "lev_heads", "albert_dim", "flat_mlp_dim", "mlp_hidden",
)
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class ConversionError(RuntimeError):
    """A checkpoint cannot be converted (missing, incomplete, inconsistent, unsupported); one line."""


@dataclass
class SourceCheckpoint:
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
        raise ConversionError(f"{path}: cannot read the saved configuration ({first})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a mapping of argument names to values")
    return data


def load_common(path: str) -> Dict[str, Any]:
    """The non-sharded part of a dist_checkpointing directory (``common.pt``)."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:  # corrupt or foreign directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{path}: not a readable dist_checkpointing checkpoint ({first})") from None


def open_checkpoint(path: str, iteration: Optional[int] = None, *, read_common: bool = True) -> SourceCheckpoint:
    """Locate and check the checkpoint at ``path`` (a root with a tracker file, or an ``iter_*`` dir)."""
    if not path:
        raise ConversionError("no checkpoint given (--load DIR)")
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(path):
        raise ConversionError(f"{path}: no such checkpoint directory")
    if not os.path.isdir(path):
        raise ConversionError(f"{path}: not a directory (give the checkpoint root that holds {TRACKER})")
    m = _ITER_DIR.match(os.path.basename(path))
    if m and os.path.isfile(os.path.join(path, "metadata.json")):
        root, it = os.path.dirname(path), int(m.group(1))
        if iteration is not None and iteration != it:
            raise ConversionError(f"{path}: holds iteration {it}, not --iteration {iteration}")
        iter_path = path
    else:
        root = path
        if iteration is None:
            try:
                it = read_tracker(root)
            except CheckpointError as e:
                raise ConversionError(str(e)) from None
            if it is None:
                found = sorted(d for d in os.listdir(root) if _ITER_DIR.match(d))
                hint = f"; found {', '.join(found[-3:])}: pass --iteration N to choose one" if found else ""
                raise ConversionError(f"{root}: no {TRACKER} (not a checkpoint root, or no save completed){hint}")
        else:
            it = int(iteration)
        iter_path = checkpoint_dir(root, it)
        if not os.path.isdir(iter_path):
            raise ConversionError(f"{iter_path}: no such checkpoint (iteration {it})")
    if not os.path.isfile(os.path.join(iter_path, "metadata.json")):
        raise ConversionError(f"{iter_path}: incomplete checkpoint (no metadata.json)")
    cfg_path = os.path.join(iter_path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"{iter_path}: no {CONFIG_NAME} (the save did not complete)")
    cfg = _read_yaml(cfg_path)
    common: Dict[str, Any] = {}
    args = dict(cfg)
    if read_common:
        common = load_common(iter_path)
        saved = common.get("args")
        if isinstance(saved, dict) and saved:
            for key in STRUCTURE_KEYS:
                if key in saved and key in cfg and saved[key] != cfg[key]:
                    raise ConversionError(
                        f"{cfg_path}: {key} is {cfg[key]!r} but the checkpoint was saved with {saved[key]!r} "
                        f"(config.yaml does not belong to this checkpoint)")
            args = dict(saved)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "input_embedding", "padded_vocab_size"):
        if args.get(key) is None:
            raise ConversionError(f"{cfg_path}: the saved configuration has no {key}")
    return SourceCheckpoint(root=root, iteration=int(it), path=iter_path, args=args, common=common)
