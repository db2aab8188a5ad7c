"""The LEV layer's own parameters, for study outside megatron: a small safetensors file and a JSON
config that rebuild the pure-torch :class:`megatron_lev.lev.LEVEmbedding` (TP=1).

Folder layout (written by ``export_lev`` or, for the ``lev`` arm, as ``lev/`` inside an HF export)::

    lev_config.json           {"vocab_size", "hidden_size", "init_method_std", "lev": LEVConfig fields}
    lev_embedding.safetensors seed.codebooks [k, b, d_s]; heads.proj_weight [h, d_s, d_s],
                              heads.proj_bias, heads.norm_weight, heads.norm_bias [h, d_s];
                              heads.delta [h, d_s, kappa, r]; heads.out_weight [h, D, r]; offset [D]

The names are ``LEVEmbedding``'s state-dict names (the TP=1 ``LEVParallelEmbedding`` has the same
ones; at TP > 1 dist_checkpointing gathers the head shards when the model is loaded at TP=1).
``load_lev_embedding(folder)`` returns the module; its ``materialize()`` is the table that the
HF export writes as ``embed_tokens``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional

from megatron_lev.models.arms import find_arm

from .source import ConversionError, check_writable, disk_full_is_one_line, open_checkpoint, saved_config

CONFIG_FILE = "lev_config.json"
WEIGHTS_FILE = "lev_embedding.safetensors"


def _lev_module(model):
    from megatron_lev.models import lev_modules

    mods = list(lev_modules(model))
    if not mods:
        raise ConversionError("the checkpoint's model has no LEV input layer (--input-embedding is not lev)")
    return mods[0]


def write_lev(model, config, model_config, iteration: Optional[int], out_dir: str, table=None) -> None:
    """Write the LEV parameters of a TP=1 model (its TransformerConfig ``config`` and ``LevModelConfig``
    ``model_config``; ``iteration``: the checkpoint's) and their config to ``out_dir``."""
    from .files import save_safetensors

    mod = _lev_module(model)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in mod.state_dict().items()}
    cfg = dataclasses.asdict(mod.lev_config)
    cfg["base"] = int(mod.base)
    meta = {"vocab_size": int(mod.vocab_size), "hidden_size": int(mod.hidden_size),
            "init_method_std": float(config.init_method_std), "lev": cfg,
            "dtype": str(next(iter(tensors.values())).dtype).replace("torch.", ""),
            "source": {"input_embedding": model_config.input_embedding, "iteration": iteration}}
    save_safetensors(tensors, os.path.join(out_dir, WEIGHTS_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def load_lev_embedding(folder: str, *, device: str = "cpu", dtype=None, compute_mode: Optional[str] = None):
    """The pure-torch ``LEVEmbedding`` stored in ``folder`` (written by ``write_lev``/``export_lev``),
    with the fused kernels registered (Triton on CUDA, numba on CPU) as in a megatron model."""
    import torch
    from safetensors.torch import load_file

    from megatron_lev.kernels import register_default_kernels
    from megatron_lev.lev import LEVConfig, LEVEmbedding

    register_default_kernels()  # so basis "auto" (and "triton") finds the fused kernels on ``device``
    cfg_path, w_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise ConversionError(f"{p}: no such file (not a LEV export folder)")
    with open(cfg_path, "r", encoding="utf-8") as f:
        meta = json.load(f)
    fields = {f.name for f in dataclasses.fields(LEVConfig)}
    lev_cfg = LEVConfig(**{k: v for k, v in meta["lev"].items() if k in fields})
    if compute_mode is not None:
        lev_cfg.compute_mode = compute_mode
    state = load_file(w_path, device=device)
    if dtype is None:
        dtype = getattr(torch, meta.get("dtype", "float32"))
    emb = LEVEmbedding(int(meta["vocab_size"]), int(meta["hidden_size"]), lev_cfg,
                       init_method_std=float(meta.get("init_method_std", 0.02)), init_statistics=False,
                       device="meta", dtype=dtype)
    missing = set(emb.state_dict()) ^ set(state)
    if missing:
        raise ConversionError(f"{w_path}: parameter names differ from LEVEmbedding's ({sorted(missing)[0]})")
    emb.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return emb.to(device)


def _export_lev_rank(src_path: str, out_dir: str, a: Dict[str, Any], iteration: int,
                     progress: bool) -> Dict[str, Any]:
    from .model_io import build_model, load_model_weights

    chunks, config, model_config = build_model(a)
    load_model_weights(chunks, src_path, log=print if progress else None)
    write_lev(chunks[0], config, model_config, iteration, out_dir)
    return {"files": [CONFIG_FILE, WEIGHTS_FILE]}


def export_lev(src: str, out_dir: str, *, iteration: Optional[int] = None, progress: bool = True,
               allow_missing_checksums: bool = False) -> str:
    """Write the LEV parameters of the checkpoint at ``src`` (lev arm) to ``out_dir``; return it."""
    from .launch import run_ranks
    from .model_io import layout_args

    out_dir = os.path.abspath(os.path.expanduser(str(out_dir)))
    check_writable(out_dir)  # before any work
    source = open_checkpoint(src, iteration, allow_missing_checksums=allow_missing_checksums)
    arm = saved_config(source).model.input_embedding
    entry = find_arm(arm)
    if entry is None or not entry.lev_layer:
        raise ConversionError(f"{source.path}: --input-embedding is {arm}, "
                              "not lev: there are no LEV parameters to export")
    if os.path.isfile(os.path.join(out_dir, WEIGHTS_FILE)):
        raise ConversionError(f"{out_dir}: already holds {WEIGHTS_FILE}; choose another --save")
    a = layout_args(source.args, 1, 1)
    with disk_full_is_one_line(out_dir, "the LEV parameters"):
        os.makedirs(out_dir, exist_ok=True)
        run_ranks(_export_lev_rank, tp=1, pp=1, args=(source.path, out_dir, a, source.iteration, progress))
    if progress:
        print(f"done: {out_dir} ({CONFIG_FILE}, {WEIGHTS_FILE})", flush=True)
    return out_dir
