"""Fit a model's sharded state dict to the keys a checkpoint actually holds before loading it.

Checkpoints move between the Transformer Engine layer spec (GPU training) and the local spec (CPU
evaluation, conversion). Both save under TE's key names (``specs.te_layer_keys_map``); what still
differs is handled here, on the requesting side, so that ``dist_checkpointing.load`` sees only keys
that exist:

- TE-only entries in the checkpoint (``*._extra_state``: FP8 scaling factors and amax history) are
  not requested by the local spec's modules; dist_checkpointing reads only what is requested, so
  they are ignored (and counted).
- ``_extra_state`` requested by TE modules but absent from the checkpoint (one written by the local
  spec) is dropped from the request; the modules keep their fresh state (``restore_missing_extra_state``).
- Checkpoints written before the local spec used TE's names hold the norms under the local names
  (``input_layernorm.weight``...); such keys are requested under those names instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Set

EXTRA_STATE = "_extra_state"


@dataclass
class KeyMatch:
    """What ``fit_to_checkpoint`` changed in a request (for the load's log line)."""

    legacy_renamed: Set[str] = field(default_factory=set)
    """Keys found under the local names used before the TE names (checkpoints of older versions)."""
    extra_state_missing: Set[str] = field(default_factory=set)
    """Requested ``_extra_state`` keys that the checkpoint does not hold (kept at their fresh state)."""
    requested: Set[str] = field(default_factory=set)
    """Every key requested (over all model chunks of this rank)."""

    def describe(self, saved: Set[str]) -> List[str]:
        """One note per kind of difference between the request and the checkpoint ``saved``."""
        notes = []
        ignored = sum(1 for k in saved if k.endswith(EXTRA_STATE) and k not in self.requested)
        if self.legacy_renamed:
            notes.append(f"{len(self.legacy_renamed)} norm keys read under the key names of checkpoints written "
                         "before the Transformer Engine names")
        if ignored:
            notes.append(f"{ignored} Transformer Engine extra-state keys (FP8 metadata) "
                         "not used by this layer spec were ignored")
        if self.extra_state_missing:
            notes.append(f"{len(self.extra_state_missing)} Transformer Engine extra-state keys are not in the "
                         "checkpoint; those modules keep their initial FP8 state")
        return notes


def saved_keys(checkpoint_dir: str) -> Set[str]:
    """Keys of every ShardedTensor and ShardedObject stored in a dist_checkpointing directory."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {v.key for v in load_sharded_metadata(str(checkpoint_dir)).values()}


def _legacy_key(key: str, keys_map: Dict[str, str]) -> str:
    """``key`` under the pre-TE local names (``...layers.self_attention.linear_qkv.layer_norm_weight`` ->
    ``...layers.input_layernorm.weight``), or ``key`` unchanged."""
    for local, te in keys_map.items():
        marker = "." + te
        if marker in key:
            return key.replace(marker, "." + local, 1)
    return key


def fit_to_checkpoint(sharded_state_dict: Dict[str, Any], saved: Set[str], match: KeyMatch) -> Dict[str, Any]:
    """The model's ``sharded_state_dict`` restricted and renamed to the checkpoint's keys ``saved``.

    Call before building the optimizer's sharded state from it (the optimizer's keys follow the
    model's). Counts go to ``match`` (one for all chunks of the model).
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values, \
        nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from .specs import te_layer_keys_map

    keys_map = te_layer_keys_map()

    def rename(v):
        key = getattr(v, "key", None)
        if isinstance(key, str):
            if key not in saved:
                old = _legacy_key(key, keys_map)
                if old != key and old in saved:
                    v.key = old
                    match.legacy_renamed.add(old)
        return v

    dict_list_map_inplace(rename, sharded_state_dict)
    missing, kept = extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, ShardedObject) and v.key.endswith(EXTRA_STATE) and v.key not in saved)
    match.extra_state_missing.update(v.key for v in nested_values(missing))
    match.requested.update(v.key for v in nested_values(kept) if isinstance(getattr(v, "key", None), str))
    return kept


def restore_missing_extra_state(module, loaded: Dict[str, Any]) -> Dict[str, Any]:
    """``loaded`` completed with the module's own ``_extra_state`` where the checkpoint had none, so
    that a strict ``load_state_dict`` accepts it."""
    own = {k: v for k, v in module.state_dict().items() if k.endswith(EXTRA_STATE) and k not in loaded}
    if own:
        loaded = dict(loaded)
        loaded.update(own)
    return loaded
