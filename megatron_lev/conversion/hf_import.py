"""Hugging Face import: a ``LlamaForCausalLM`` directory as a megatron-lev training checkpoint.

The directory holds ``config.json`` and the weights as safetensors (``model.safetensors``, or shards
listed by ``model.safetensors.index.json``); tied or untied embeddings, grouped-query attention. The
tensors are read through :data:`megatron_lev.conversion.hf.WEIGHT_MAP` backwards (the export's map):
every tensor of the directory is either mapped or one of the derived buffers listed in
``IGNORED`` (rotary frequencies), every parameter of the megatron model is filled, and every shape is
checked against ``config.json`` before anything is written. Architectures without a faithful
megatron-core equivalent (another ``model_type``, biases, another activation, a RoPE scaling other than
Llama 3.1's) are refused with one line naming the setting. Llama 3.1-3.3's ``rope_scaling`` (``rope_type
llama3``) becomes ``--use-rope-scaling --rope-scaling-factor F`` (megatron-core's RotaryEmbedding).

The result is a checkpoint at iteration 0 (``iter_0000000``, no optimizer state) whose
``config.yaml`` holds the model, the tokenizer (the directory's ``tokenizer.json`` copied to
``SAVE/tokenizer``; without one, a ``NullTokenizer`` over the model's ids) and the layout. Training
hyperparameters (``lr``, ``train_iters``, data) are the user's: ``pretrain_lev.py --config
SAVE/iter_0000000/config.yaml --load SAVE --lr ... --train-iters ... --data-path ...``.

Vocabulary: megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``;
rows beyond the directory's ``vocab_size`` are zero in both matrices (the tokenizer never produces
those ids; the logits of the real ids are the HF model's). The saved ``make_vocab_size_divisible_by``
reproduces that row count from the tokenizer at the chosen TP.

Steps: the model is built at TP=1 on one CPU process, filled tensor by tensor, and saved with the
training checkpointer; for another layout that checkpoint is then resharded by dist_checkpointing
(:func:`megatron_lev.conversion.reshard_checkpoint`) and removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from megatron_lev.config.saved import SavedConfig

from .hf import LLAMA3_ROPE, OUTPUT, LlamaShape, head_layout, mapped_names, megatron_tensors
from .source import ConversionError, disk_full_is_one_line, read_config, save_target

# Tensors some Llama checkpoints carry that are derived from config.json (not parameters).
IGNORED = (re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


@dataclass
class HFModel:
    """A Llama directory as read before conversion: its config and where each tensor lives."""

    path: str
    config: Dict[str, Any]
    files: Dict[str, str]
    """HF tensor name -> safetensors file (absolute path)."""
    shapes: Dict[str, Tuple[int, ...]]
    ignored: List[str] = field(default_factory=list)
    """Derived buffers present in the files and not converted (``IGNORED``)."""

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


def _refuse(path: str, setting: str, why: str) -> None:
    raise ConversionError(f"{path}: cannot import {setting} ({why})")


def check_llama_config(cfg: Dict[str, Any], path: str) -> None:
    """Raise ConversionError (one line naming the setting) for a config without a megatron equivalent."""
    arch = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" or (arch and arch != ["LlamaForCausalLM"]):
        _refuse(path, f"architecture {','.join(arch) or cfg.get('model_type')!s}",
                "only LlamaForCausalLM (model_type llama) is mapped")
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(path, f"hidden_act {cfg.get('hidden_act')}", "the SwiGLU MLP uses silu")
    for key, why in (("attention_bias", "megatron's Llama layers have no biases"),
                     ("mlp_bias", "megatron's Llama layers have no biases")):
        if cfg.get(key):
            _refuse(path, f"{key} {cfg.get(key)!r}", why)
    rope_scaling_factor(cfg, path)
    theta = _rope_theta(cfg)
    if float(theta) != int(theta):
        _refuse(path, f"rope_theta {theta}", "--rotary-base is an integer")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ConversionError(f"{path}/config.json: {key} is missing or not a positive integer")


def _rope_theta(cfg: Dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}  # transformers >= 5 nests it
    return float(cfg.get("rope_theta", params.get("rope_theta", 10000.0) if isinstance(params, dict) else 10000.0))


def rope_scaling_factor(cfg: Dict[str, Any], path: str) -> Optional[float]:
    """The factor of a Llama 3.1-3.3 ``rope_scaling`` (``rope_parameters`` in transformers >= 5), None without
    scaling; ConversionError for a type or parameter megatron-core's Llama-3.1 scaling cannot honour (its
    low/high frequency factors and original context are fixed at 1, 4 and 8192)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        _refuse(path, f"rope_scaling {params!r}", "expected a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "llama3":
        _refuse(path, f"rope_type {kind!r}", "only Llama 3.1's scaling (rope_type llama3) is mapped, as "
                "--use-rope-scaling")
    for key, value in LLAMA3_ROPE.items():
        if key in params and float(params[key]) != value:
            _refuse(path, f"rope_scaling {key} {params[key]}", f"megatron-core's Llama-3.1 RoPE scaling fixes it at "
                    f"{value:g}")
    if not isinstance(params.get("factor"), (int, float)) or params["factor"] < 1:
        _refuse(path, f"rope_scaling factor {params.get('factor')!r}", "--rope-scaling-factor needs a number >= 1")
    return float(params["factor"])


def _hf_shape(cfg: Dict[str, Any]) -> LlamaShape:
    """The dimensions of ``config.json`` that the weight map's split/join functions read."""
    n = int(cfg["num_attention_heads"])
    return LlamaShape(num_layers=int(cfg["num_hidden_layers"]), num_attention_heads=n,
                      num_query_groups=int(cfg.get("num_key_value_heads") or n), hidden_size=int(cfg["hidden_size"]),
                      kv_channels=int(cfg.get("head_dim") or cfg["hidden_size"] // n))


def expected_shapes(cfg: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """HF tensor name -> shape implied by ``config.json``."""
    shape = _hf_shape(cfg)
    n, g, hd = head_layout(shape)
    D, F, V = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    per_layer = {"input_layernorm.weight": (D,), "self_attn.q_proj.weight": (n * hd, D),
                 "self_attn.k_proj.weight": (g * hd, D), "self_attn.v_proj.weight": (g * hd, D),
                 "self_attn.o_proj.weight": (D, n * hd), "post_attention_layernorm.weight": (D,),
                 "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for _entry, _meg, hf in mapped_names(shape.num_layers, tied=False):
        for name in hf:
            if name.startswith("model.layers."):
                out[name] = per_layer[name.split(".", 3)[3]]
    return out


def read_hf_model(path: str) -> HFModel:
    """Read and check a Llama directory (config, safetensors headers, tensor names and shapes)."""
    from safetensors import safe_open

    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isdir(path):
        raise ConversionError(f"--hf-model {path}: no such directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"--hf-model {path}: no config.json (not a Hugging Face model directory)")
    try:
        with open(cfg_path, "r", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{cfg_path}: not readable JSON ({str(e).splitlines()[0]})") from None
    check_llama_config(cfg, path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, "r", encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        bins = [n for n in os.listdir(path) if n.endswith(".bin")]
        hint = " (found PyTorch .bin weights: save them as safetensors first)" if bins else ""
        raise ConversionError(f"--hf-model {path}: no model.safetensors or model.safetensors.index.json{hint}")
    files: Dict[str, str] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for shard in shards:
        fpath = os.path.join(path, shard)
        if not os.path.isfile(fpath):
            raise ConversionError(f"{fpath}: listed in model.safetensors.index.json but missing")
        with safe_open(fpath, framework="pt") as f:
            for name in f.keys():
                files[name] = fpath
                shapes[name] = tuple(f.get_slice(name).get_shape())
    model = HFModel(path=path, config=cfg, files=files, shapes=shapes)
    model.ignored = check_tensors(model)
    return model


def check_tensors(model: HFModel) -> List[str]:
    """Every tensor mapped (or a derived buffer), none missing, shapes as config.json says; returns the
    names of the ignored buffers. A tied model may carry ``lm_head.weight`` only as a copy of the table."""
    expected = expected_shapes(model.config)
    need = [h for _e, _m, hf in mapped_names(int(model.config["num_hidden_layers"]), model.tied) for h in hf]
    missing = [n for n in need if n not in model.shapes]
    if missing:
        raise ConversionError(f"{model.path}: tensor {missing[0]} is missing ({len(missing)} missing in all; "
                              "the checkpoint is incomplete or not a Llama model)")
    ignored = [n for n in model.shapes if any(p.match(n) for p in IGNORED)]
    extra = sorted(set(model.shapes) - set(need) - set(ignored) - ({OUTPUT.hf[0]} if model.tied else set()))
    if extra:
        raise ConversionError(f"{model.path}: tensor {extra[0]} has no megatron equivalent "
                              f"({len(extra)} unmapped in all; only LlamaForCausalLM weights are mapped)")
    for name in need + ([OUTPUT.hf[0]] if model.tied and OUTPUT.hf[0] in model.shapes else []):
        got, want = model.shapes[name], expected[name]
        if got != want:
            raise ConversionError(f"{model.path}: {name} has shape {list(got)} but config.json implies "
                                  f"{list(want)} (shape mismatch)")
    if model.tied and OUTPUT.hf[0] in model.shapes:
        from safetensors import safe_open

        def get(name):
            with safe_open(model.files[name], framework="pt") as f:
                return f.get_tensor(name)

        import torch

        if not torch.equal(get(OUTPUT.hf[0]), get("model.embed_tokens.weight")):
            raise ConversionError(f"{model.path}: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight; set tie_word_embeddings false in config.json")
    return ignored


# ------------------------------------------------------------------------------------- arguments


def _tokenizer_flags(model: HFModel, save: str, use_tokenizer: bool, log) -> Tuple[List[str], int]:
    """pretrain_lev.py tokenizer flags for the checkpoint and the tokenizer's id count. The directory's
    tokenizer files are copied to ``save/tokenizer``; without them, a NullTokenizer covers the model's ids."""
    from megatron_lev.tokenizer import build_tokenizer

    V = int(model.config["vocab_size"])
    if use_tokenizer and os.path.isfile(os.path.join(model.path, "tokenizer.json")):
        dst = os.path.join(save, "tokenizer")
        os.makedirs(dst, exist_ok=True)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(model.path, name)):
                shutil.copy(os.path.join(model.path, name), dst)
        try:
            tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=dst)
        except (ValueError, OSError) as e:
            log(f"WARNING: {model.path}/tokenizer.json not usable ({str(e).splitlines()[0]}); "
                "the checkpoint gets a NullTokenizer")
        else:
            if tok.vocab_size > V:
                raise ConversionError(f"{model.path}: the tokenizer has {tok.vocab_size} ids but the model only "
                                      f"{V} rows (vocab_size in config.json)")
            _keep_exported_identity(model.path, dst, tok, log)
            return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", dst], tok.vocab_size
    # NullTokenizer(vocab_size=N) has ids 0..N (N = EOD): N + 1 ids, the model's rows.
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(V - 1)], V


def _keep_exported_identity(hf_dir: str, dst: str, tok, log) -> None:
    """The tokenizer an export recorded (``tokenizer_fingerprint.json``: the checkpoint's, e.g. GPT-2 BPE
    files, written in HF form) stays the imported checkpoint's: the record is copied to ``dst`` with the
    fingerprint of the copied files, which then stand for it (``tokenizer.fingerprint``); the re-imported
    model is accepted on the datasets its checkpoint was trained on."""
    from megatron_lev.tokenizer import tokenizer_fingerprint
    from megatron_lev.tokenizer.fingerprint import FILES_RECORDED, MODEL_DIR_SIDECAR, read_sidecar, write_sidecar

    if os.path.exists(os.path.join(dst, MODEL_DIR_SIDECAR)):
        os.remove(os.path.join(dst, MODEL_DIR_SIDECAR))  # an earlier import's: the files' own fingerprint below
    try:
        recorded = read_sidecar(os.path.join(hf_dir, MODEL_DIR_SIDECAR))
    except ValueError as e:
        raise ConversionError(f"{e.args[0].split('; ')[0]}; remove it to import the tokenizer as its files "
                              "are") from None
    if recorded is None:
        return
    if int(recorded.get("vocab_size", -1)) != tok.vocab_size:
        log(f"WARNING: {hf_dir}/{MODEL_DIR_SIDECAR} records a tokenizer of {recorded.get('vocab_size')} ids, its "
            f"tokenizer.json has {tok.vocab_size}: the record is not kept")
        return
    write_sidecar(os.path.join(dst, MODEL_DIR_SIDECAR), dict(recorded, **{FILES_RECORDED: [tokenizer_fingerprint(tok)]}))


def import_args(model: HFModel, save: str, *, tp: int, pp: int, seq_length: Optional[int] = None,
                make_vocab_size_divisible_by: int = 128, dtype: Optional[str] = None, tokenizer: bool = True,
                log=print) -> SavedConfig:
    """The configuration of the imported model at TP x PP (pretrain_lev.py's parser and validation, resolved),
    with ``padded_vocab_size`` set. Training hyperparameters and data are left unset."""
    from megatron_lev.tokenizer import padded_vocab_size
    from megatron_lev.arguments import parse_args, resolved_config
    from megatron_lev.lev.config import ConfigError

    cfg = model.config
    h = _hf_shape(cfg)
    n, g, hd = head_layout(h)
    dt = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dt not in _DTYPES:
        raise ConversionError(f"--dtype {dt!r}: choose float32, bfloat16 or float16")
    dt = _DTYPES[dt]
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    flags = [
        "--num-layers", str(h.num_layers), "--hidden-size", str(h.hidden_size),
        "--ffn-hidden-size", str(cfg["intermediate_size"]), "--num-attention-heads", str(n),
        "--kv-channels", str(hd), "--seq-length", str(seq_length or max_pos),
        "--max-position-embeddings", str(max_pos), "--position-embedding-type", "rope",
        "--rotary-base", str(int(_rope_theta(cfg))), "--normalization", "RMSNorm",
        "--norm-epsilon", repr(float(cfg.get("rms_norm_eps", 1e-6))), "--swiglu", "--disable-bias-linear",
        "--init-method-std", repr(float(cfg.get("initializer_range", 0.02))),
        "--hidden-dropout", "0", "--attention-dropout", repr(float(cfg.get("attention_dropout", 0.0))),
        "--input-embedding", "tied" if model.tied else "untied",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by),
        # Placeholders for the validation only (removed below): the training run gives its own.
        "--micro-batch-size", "1", "--train-iters", "0", "--lr", "0", "--mock-data",
    ]
    if g != n:
        flags += ["--group-query-attention", "--num-query-groups", str(g)]
    factor = rope_scaling_factor(cfg, model.path)
    if factor is not None:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(factor)]
    if dt != "float32":
        flags.append("--bf16" if dt == "bfloat16" else "--fp16")
    tok_flags, tok_vocab = _tokenizer_flags(model, save, tokenizer, log)
    try:
        args = parse_args(flags + tok_flags, world_size=tp * pp)
    except ConfigError as e:
        raise ConversionError(f"{model.path}: {e}") from None
    V = int(cfg["vocab_size"])
    padded = padded_vocab_size(V, make_vocab_size_divisible_by, tp)
    if padded_vocab_size(tok_vocab, make_vocab_size_divisible_by, tp) != padded:
        args.make_vocab_size_divisible_by = padded // tp  # pads the tokenizer's ids to the same row count
    a = resolved_config(args)
    a.update(padded_vocab_size=padded, lr=None, train_iters=None, lr_decay_iters=None, mock_data=False,
             micro_batch_size=None, global_batch_size=None, num_microbatches=None)
    return read_config(a)


# ------------------------------------------------------------------------------------------ the run


def _import_rank(files: Dict[str, str], dst: str, a: SavedConfig, tied: bool, progress: bool) -> Dict[str, Any]:
    import torch
    from safetensors import safe_open

    from megatron_lev.distributed import set_seed

    from .model_io import build_model, save_model_checkpoint

    set_seed(a.run.run.seed)
    chunks, config, model_config = build_model(a)
    model = chunks[0]
    state = model.state_dict(keep_vars=True)
    handles: Dict[str, Any] = {}

    def get(name):
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        return handles[path].get_tensor(name)

    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]
    count = 0
    with torch.no_grad():
        for name, tensor in megatron_tensors(get, config, keys, tied, int(model_config.vocab_size)):
            target = state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ConversionError(f"{name}: the Hugging Face tensors give shape {list(tensor.shape)}, the "
                                      f"megatron model has {list(target.shape)} (shape mismatch)")
            target.copy_(tensor.to(target.dtype))
            count += 1
    handles.clear()
    log = print if progress else (lambda m: None)
    save_model_checkpoint(chunks, dst, 0, a, {}, log=log)
    return {"tensors": count, "params": int(sum(p.numel() for p in model.parameters()))}


def import_hf(hf_model: str, save: str, *, tp: int = 1, pp: int = 1, seq_length: Optional[int] = None,
              make_vocab_size_divisible_by: int = 128, dtype: Optional[str] = None, tokenizer: bool = True,
              progress: bool = True) -> str:
    """Convert the ``LlamaForCausalLM`` directory ``hf_model`` into a megatron-lev checkpoint root ``save``
    at TP=``tp`` x PP=``pp``; return the ``iter_0000000`` directory."""
    log = print if progress else (lambda m: None)
    model = read_hf_model(hf_model)
    save = save_target(save)
    if int(model.config["num_hidden_layers"]) % pp:
        raise ConversionError(f"--pipeline-model-parallel-size {pp} does not divide the model's "
                              f"{model.config['num_hidden_layers']} layers")
    with disk_full_is_one_line(save, "the imported checkpoint"):
        _write_import(model, save, tp, pp, seq_length, make_vocab_size_divisible_by, dtype, tokenizer, progress, log)
    out = os.path.join(save, "iter_0000000")
    log(f"done: {out}. Continue with pretrain_lev.py --config {out}/config.yaml --load {save} "
        "--lr ... --train-iters ... --data-path ...")
    return out


def _write_import(model, save, tp, pp, seq_length, make_vocab_size_divisible_by, dtype, tokenizer, progress, log):
    from .launch import run_ranks
    from .model_io import layout_args
    from .reshard import reshard_checkpoint

    os.makedirs(save, exist_ok=True)
    saved = import_args(model, save, tp=tp, pp=pp, seq_length=seq_length,
                    make_vocab_size_divisible_by=make_vocab_size_divisible_by, dtype=dtype, tokenizer=tokenizer,
                    log=log)
    ignored = model.ignored
    m = saved.run.model
    log(f"importing {model.path} (LlamaForCausalLM, {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{'tied' if model.tied else 'untied'}, vocab {model.config['vocab_size']} -> {m.padded_vocab_size} "
        f"rows, {m.params_dtype_name}) -> {save} at TP={tp} PP={pp}"
        + (f"; {len(ignored)} derived buffer(s) ignored (rotary inv_freq)" if ignored else ""))
    direct = tp == 1 and pp == 1
    first = save if direct else os.path.join(save, ".import-tp1")
    if os.path.isdir(first) and not direct:
        shutil.rmtree(first)
    run_ranks(_import_rank, tp=1, pp=1, args=(model.files, first, layout_args(saved, 1, 1), model.tied, progress))
    if not direct:
        reshard_checkpoint(first, save, tp=tp, pp=pp, progress=progress)
        shutil.rmtree(first)
