"""The YAML config file, in both directions: ``--config FILE.yaml`` read into parser defaults, and
``resolved_config(args)``, the flat mapping of every argument after validation (printed at start-up,
written as ``config.yaml`` beside each checkpoint; feeding it back through ``--config`` reproduces the
same arguments).

The YAML file maps argument names to values. Names may be written as the flag (``num-layers``,
``--num-layers``) or as the attribute (``num_layers``); a nested mapping is flattened with ``_``
(``lev: {heads: 8}`` is ``lev_heads``). Unknown names are an error that names the key.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Dict, Mapping, Optional, Union

from megatron_lev.config_flags import Number
from megatron_lev.lev.config import ConfigError

from .megatron_lm import NO_OPS, refusal

# Arguments that describe the run rather than the model/optimisation: not compared on resume.
_DERIVED = ("data_parallel_size", "world_size", "num_microbatches", "padded_vocab_size", "params_dtype_name",
            "tokenizer_fingerprint")


def _str2bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


class _TwoSpellings(ValueError):
    """Two keys of the file name one argument (``num_layers`` and ``num-layers``; ``lev: {heads}`` and
    ``lev_heads``): the message names both as written."""


def _flatten(d: Dict[str, Any], prefix: str = "", spelled: str = "",
             written: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """``{dest: value}`` of a mapping of names (flag or attribute spelling, nested mappings joined by ``_``);
    two keys that name the same argument are refused (:class:`_TwoSpellings`): the last would win, silently."""
    written = {} if written is None else written
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = str(k).lstrip("-").replace("-", "_")
        key = f"{prefix}_{key}" if prefix else key
        as_written = f"{spelled}.{k}" if spelled else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key, as_written, written))
            continue
        if key in written:
            raise _TwoSpellings(f"{written[key]!r} and {as_written!r} both set --{key.replace('_', '-')}; keep one")
        written[key] = as_written
        out[key] = v
    return out


class _RepeatedKey(ValueError):
    """A key written twice in one mapping of the file (YAML keeps the last, silently)."""


def _unique_key_loader():
    """yaml's SafeLoader, refusing a key repeated in one mapping (:class:`_RepeatedKey`, naming both lines)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        lines: Dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                first = lines.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:
                continue  # an unhashable key: construct_mapping refuses it (not valid YAML)
            if first != key_node.start_mark.line + 1:
                raise _RepeatedKey(f"{key!r} is given twice (lines {first} and {key_node.start_mark.line + 1}); "
                                   "keep one")
        return loader.construct_mapping(node, deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return UniqueKeyLoader


def load_yaml_config(path: str, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Read a YAML file of arguments; return ``{dest: value}`` converted with each flag's type."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = yaml.load(f, Loader=_unique_key_loader())
    except _RepeatedKey as e:
        raise ConfigError(f"--config {path}: {e}") from None
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "parse error"
        raise ConfigError(f"--config {path}: not valid YAML ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of argument names to values")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out: Dict[str, Any] = {}
    # Derived values (a saved config.yaml holds them) are dropped before nested mappings are flattened:
    # the tokenizer fingerprint is a mapping whose fields are no flags.
    data = {k: v for k, v in data.items() if k not in _DERIVED}
    try:
        flat = _flatten(data)
    except _TwoSpellings as e:
        raise ConfigError(f"--config {path}: {e}") from None
    for key, value in flat.items():
        if key in _DERIVED or "--" + key.replace("_", "-") in NO_OPS:
            continue  # a no-op flag (older config.yaml files hold log_throughput: false)
        if key not in actions:
            reason = refusal(key) or f"unknown argument {key!r} (flag --{key.replace('_', '-')})"
            raise ConfigError(f"--config {path}: {reason}")
        action = actions[key]
        flag = action.option_strings[0]
        try:
            out[key] = _convert(action, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"--config {path}: {key}: invalid value {value!r} for {flag} ({e})") from None
    return out


def _convert(action: argparse.Action, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return _str2bool(value)
    conv = action.type or (lambda x: x)
    if action.nargs in ("*", "+"):
        items = value if isinstance(value, (list, tuple)) else str(value).split()
        if any(isinstance(v, (list, tuple, dict)) for v in items):
            raise ValueError("expected a list of single values")
        vals = [conv(v) if not isinstance(v, str) or action.type is None else conv(v) for v in items]
        vals = [str(v) if action.type is None else v for v in vals]
        if action.choices is not None:
            for v in vals:
                if v not in action.choices:
                    raise ValueError(f"choose from {', '.join(map(str, action.choices))}")
        return vals
    if isinstance(value, (list, tuple)):  # would become the text "['a', 'b']"
        raise ValueError("expected one value, not a list")
    kind = action.type.kind if isinstance(action.type, Number) else action.type
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        v = int(value)
    elif kind is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        v = float(value)
    else:
        v = conv(value) if action.type else value
        if action.type is None and not isinstance(v, str):
            v = str(v)
    if action.choices is not None and v not in action.choices:
        raise ValueError(f"choose from {', '.join(map(str, action.choices))}")
    return action.type.check(v) if isinstance(action.type, Number) else v


def resolved_config(args: Union[argparse.Namespace, Mapping[str, Any]]) -> Dict[str, Any]:
    """Every argument after validation (the namespace, or ``RunConfig.to_saved_args()``), as plain YAML-able
    values (sorted by name)."""
    out: Dict[str, Any] = {}
    for k, v in sorted((vars(args) if isinstance(args, argparse.Namespace) else dict(args)).items()):
        if k == "config" or k.startswith("_"):
            continue
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
            v = str(v)
        out[k] = v
    return out


def config_to_yaml(cfg: Dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(cfg, sort_keys=True, default_flow_style=False)


def format_config(cfg: Dict[str, Any]) -> str:
    """Megatron-LM's start-up block: ``------ arguments ------`` then ``  name .... value`` lines."""
    lines = ["------------------------ arguments ------------------------"]
    for k, v in cfg.items():
        dots = "." * max(1, 48 - len(k))
        lines.append(f"  {k} {dots} {v}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
