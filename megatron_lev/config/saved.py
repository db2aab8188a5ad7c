"""A checkpoint's saved arguments (``config.yaml``, and the same dictionary inside its common state) as
typed values: :class:`SavedConfig`, the :class:`RunConfig` they make and what the file holds beyond it.

Every read of the saved form by name is here or in :mod:`run`: ``checkpoint`` checks a resumed run's
structure and tokenizer against a :class:`SavedConfig`, and the conversions hand one between their ranks
(re-laid-out with :meth:`SavedConfig.relayout`) and write it back whole (:meth:`SavedConfig.to_saved_args`).
The functions below compare two saved dictionaries key by key (``config.yaml`` against the copy saved
inside the checkpoint: a file edited after the save).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Mapping, Optional, Tuple

from .run import RunConfig, flat_names

# The settings a saved configuration must hold to describe a model at all (checked first, by name).
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "input_embedding", "padded_vocab_size")


@dataclass(frozen=True)
class SavedConfig:
    """A saved configuration: the run configuration it makes, the keys it held, and the keys no setting
    reads (a flag since removed), kept as written when the configuration is saved again."""

    run: RunConfig
    """The typed configuration (a setting the file lacks takes its field's default)."""

    given: FrozenSet[str] = frozenset()
    """The names the file held (a check of a setting an older file lacks is skipped)."""

    unread: Dict[str, Any] = field(default_factory=dict)
    """The file's keys that are no setting's, as written."""

    @classmethod
    def read(cls, saved: Mapping[str, Any], source: str = "config.yaml") -> "SavedConfig":
        """The typed view of the flat ``saved`` arguments (``RunConfig.from_saved_args``: ConfigError, one line
        naming ``source``, for a file that does not make a run configuration)."""
        names = set(flat_names())
        return cls(run=RunConfig.from_saved_args(saved, source), given=frozenset(saved),
                   unread={k: v for k, v in saved.items() if k not in names})

    def to_saved_args(self) -> Dict[str, Any]:
        """The flat arguments to save again: the configuration's values and the unread keys as they were."""
        return dict(self.unread, **self.run.to_saved_args())

    def relayout(self, tp: int, pp: int, vpp: Optional[int] = None) -> "SavedConfig":
        """This configuration at TP x PP (``RunConfig.relayout``, data-parallel size 1); the unread keys kept."""
        return dataclasses.replace(self, run=self.run.relayout(tp, pp, vpp))

    def differences(self, run: RunConfig, names: Iterable[str]) -> Iterator[Tuple[str, Any, Any]]:
        """(name, saved value, ``run``'s value) for each of ``names`` the file held whose value ``run`` does
        not have (lists and tuples alike)."""
        saved, now = self.run.to_saved_args(), run.to_saved_args()
        for name in names:
            if name in self.given and _plain(saved.get(name)) != _plain(now.get(name)):
                yield name, saved.get(name), now.get(name)

    def holds(self, name: str) -> bool:
        """The file held ``name`` (a setting added after it was written is not held)."""
        return name in self.given


def missing_model_key(saved: Mapping[str, Any]) -> Optional[str]:
    """The first of :data:`MODEL_KEYS` that ``saved`` lacks or holds as None, else None."""
    return next((k for k in MODEL_KEYS if saved.get(k) is None), None)


def recorded_checksums(saved: Any) -> Optional[bool]:
    """Whether saved arguments of a release that recorded checksums turned them on (``--no-ckpt-checksums``
    unset); None when they do not say."""
    if isinstance(saved, dict) and "no_ckpt_checksums" in saved:
        return not saved["no_ckpt_checksums"]
    return None


def changed_keys(written: Mapping[str, Any], saved: Mapping[str, Any]) -> List[Tuple[str, str, str]]:
    """(key, value in ``written``, value in ``saved``: a repr or "absent") of each key where a
    ``config.yaml`` (``written``) differs from the arguments saved in the checkpoint (``saved``, compared in
    the form a YAML round trip gives it), sorted by key."""
    saved = _yaml_form(dict(saved))
    missing = object()

    def value(d, k):
        return repr(d[k]) if k in d else "absent"

    return [(k, value(written, k), value(saved, k)) for k in sorted(set(written) | set(saved), key=str)
            if not _same(written.get(k, missing), saved.get(k, missing))]


def _yaml_form(value: Any) -> Any:
    """``value`` as config.yaml holds it after a round trip (tuples are lists there)."""
    import yaml

    return yaml.safe_load(yaml.safe_dump(value))


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)  # NaN is NaN


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
