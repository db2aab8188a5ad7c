"""Hugging Face export of a megatron-lev checkpoint, as the ``transformers`` class that computes the same
function, and the Llama weight map that the import (:mod:`megatron_lev.conversion.hf_import`) reads backwards.

Classes (:func:`check_hf_compatible` picks one; anything else is refused with one line naming the setting):

- ``LlamaForCausalLM``: RMSNorm, SwiGLU, RoPE over the whole head (non-interleaved), no biases.
- ``GPT2LMHeadModel``: Megatron-LM's GPT-3 models: LayerNorm, GeLU, learned absolute positions, biases
  (a model without biases is written with zero ones), one key/value head per query head. GPT-2 is the
  class that maps exactly: GPT-NeoX has rotary positions and no learned position table. Its ``gelu`` is
  torch's exact GeLU, megatron's ``activation_func``; megatron's fused bias-GeLU kernel on a GPU computes
  the tanh approximation instead (``gelu_pytorch_tanh``: 4e-4 apart in the logits of the tests' 2-layer
  random model, whose logits reach 2.3).
- ``MixtralForCausalLM``: Llama's layers with a mixture of experts in every one (megatron's top-k router
  with softmax over the selected logits is Mixtral's softmax, top-k, renormalise), experts' ``linear_fc1``
  = ``[w1; w3]``, ``linear_fc2`` = ``w2`` (:data:`MIXTRAL_MAP`).

A zero-centred norm (``--apply-layernorm-1p``: megatron stores the scale minus 1) is written with the 1
added, in each class.

Llama's weight map (:data:`WEIGHT_MAP`; megatron-core GPT state-dict names, local or Transformer Engine layer
spec, at TP=1 <-> HF Llama names); ``{i}`` is the layer index. The same table drives both directions:

====================================================================  ==============================================
megatron-core                                                         Hugging Face Llama
====================================================================  ==============================================
embedding.word_embeddings.weight (tied, untied)                       model.embed_tokens.weight
embedding.arm.* (albert, flat_mlp, factored_mlp, lev)                 model.embed_tokens.weight = materialised table
decoder.layers.{i}.input_layernorm.weight                             model.layers.{i}.input_layernorm.weight
  (TE: decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight)
decoder.layers.{i}.self_attention.linear_qkv.weight                   model.layers.{i}.self_attn.{q,k,v}_proj.weight
decoder.layers.{i}.self_attention.linear_proj.weight                  model.layers.{i}.self_attn.o_proj.weight
decoder.layers.{i}.pre_mlp_layernorm.weight                           model.layers.{i}.post_attention_layernorm.weight
  (TE: decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight)
decoder.layers.{i}.mlp.linear_fc1.weight                              model.layers.{i}.mlp.{gate,up}_proj.weight
decoder.layers.{i}.mlp.linear_fc2.weight                              model.layers.{i}.mlp.down_proj.weight
decoder.final_layernorm.weight                                        model.norm.weight
output_layer.weight (every arm but tied)                              lm_head.weight
====================================================================  ==============================================

- ``linear_qkv`` rows are grouped per query group: for each of the ``g`` groups, its ``n/g`` query
  heads, then its key head, then its value head (``head_dim`` rows each). They are split into
  ``q_proj`` [n*hd, D], ``k_proj`` [g*hd, D], ``v_proj`` [g*hd, D]. No permutation is needed for RoPE:
  megatron's rotary embedding (``rotary_interleaved=False``) rotates the two halves of each head
  (``rotate_half``), as HF Llama does.
- ``linear_fc1`` is ``[gate; up]`` (megatron's SwiGLU: ``silu(x W_gate) * (x W_up)``).
- ``tie_word_embeddings`` is true only for the ``tied`` arm (then ``lm_head`` is not written).
- Vocabulary: by default the padded row count (Megatron's ``padded_vocab_size``) is kept in
  ``config.json`` (``vocab_size``) and in both ``embed_tokens`` and ``lm_head``: the logits equal
  megatron's; the extra ids are never produced by the tokenizer. ``trim_vocab=True`` keeps only the
  tokenizer's ids in both matrices (and ``vocab_size`` is the tokenizer's).

Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` above ``max_shard_size``),
tokenizer files when the checkpoint's tokenizer is known and its files exist, and for the ``lev``
arm a ``lev/`` folder (:mod:`megatron_lev.conversion.lev_export`). Tensors are produced one at a time
from the loaded TP=1 model and written shard by shard (peak: the model plus one shard).
"""

from __future__ import annotations

import json
import os
import sys
import re
import shutil
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from megatron_lev.config import ModelRunConfig, RunConfig
from megatron_lev.models.arms import get_arm
from megatron_lev.models.config import INPUT_EMBEDDINGS
from megatron_lev.tokenizer import TokenizerSpec
from megatron_lev.tokenizer.fingerprint import MODEL_DIR_SIDECAR, write_sidecar
from megatron_lev.tokenizer.tokenizers import SENTENCEPIECE_TYPES

from .source import ConversionError, check_writable, disk_full_is_one_line, open_checkpoint, saved_config

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
# What megatron-core's RotaryEmbedding(rope_scaling=True) computes besides its factor (_apply_scaling's
# defaults): Llama 3.1-3.3's rope_scaling (rope_type llama3) with these values.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

@dataclass(frozen=True)
class MappedWeight:
    """One row of the weight map: a megatron-core tensor and the Hugging Face Llama tensor(s) it holds."""

    megatron: Tuple[str, ...]
    """Megatron-core state-dict names, local layer spec first, then the Transformer Engine spec's alias
    (its norms are fused into the following linear layer); ``{i}`` is the layer index."""
    hf: Tuple[str, ...]
    """HF names; more than one when megatron fuses them into one tensor."""
    fused: Optional[str] = None
    """How the HF tensors are fused: "qkv" (grouped per query group, :func:`split_qkv`), "fc1"
    (``[gate; up]``, :func:`split_fc1`), "c_attn" (GPT-2's ``[q | k | v]`` of a transposed Conv1D, weight or
    bias), "conv1d" (GPT-2's Conv1D stores the transpose), or None (the same tensor)."""
    vocab: bool = False
    """Rows are vocabulary ids (padded on the megatron side)."""
    norm: bool = False
    """A norm's scale: megatron's zero-centred gamma (``--apply-layernorm-1p``) is written with its 1 added."""
    optional_bias: bool = False
    """A linear layer's bias that megatron lacks with ``--disable-bias-linear``: then written as zeros, one
    per row of the layer's weight (the HF class always has it; zeros compute the same)."""


# The weight map, read in both directions (export: megatron -> HF, import: HF -> megatron), in HF order.
WEIGHT_MAP: Tuple[MappedWeight, ...] = (
    MappedWeight(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), vocab=True),
    MappedWeight(("decoder.layers.{i}.input_layernorm.weight",
                  "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight"),
                 ("model.layers.{i}.input_layernorm.weight",), norm=True),
    MappedWeight(("decoder.layers.{i}.self_attention.linear_qkv.weight",),
                 ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                  "model.layers.{i}.self_attn.v_proj.weight"), fused="qkv"),
    MappedWeight(("decoder.layers.{i}.self_attention.linear_proj.weight",),
                 ("model.layers.{i}.self_attn.o_proj.weight",)),
    MappedWeight(("decoder.layers.{i}.pre_mlp_layernorm.weight",
                  "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight"),
                 ("model.layers.{i}.post_attention_layernorm.weight",), norm=True),
    MappedWeight(("decoder.layers.{i}.mlp.linear_fc1.weight",),
                 ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), fused="fc1"),
    MappedWeight(("decoder.layers.{i}.mlp.linear_fc2.weight",), ("model.layers.{i}.mlp.down_proj.weight",)),
    MappedWeight(("decoder.final_layernorm.weight",), ("model.norm.weight",), norm=True),
    MappedWeight(("output_layer.weight",), ("lm_head.weight",), vocab=True),
)
EMBEDDING, OUTPUT = WEIGHT_MAP[0], WEIGHT_MAP[-1]
_LAYER = "decoder.layers.{i}."


def _ln(megatron: str, te: str, hf: str, part: str) -> MappedWeight:
    """A LayerNorm's weight or bias (``part``); the TE spec fuses it into the next linear layer."""
    return MappedWeight((_LAYER + f"{megatron}.{part}", _LAYER + f"{te}.layer_norm_{part}"), (hf + f".{part}",),
                        norm=part == "weight")


# GPT-2 (GPT2LMHeadModel): LayerNorm with biases, GeLU MLP, biases on every linear layer, learned positions,
# one key/value head per query head. Conv1D layers store [in, out]: the transpose of megatron's Linear.
_H = "transformer.h.{i}."
GPT2_MAP: Tuple[MappedWeight, ...] = (
    MappedWeight(("embedding.word_embeddings.weight",), ("transformer.wte.weight",), vocab=True),
    MappedWeight(("embedding.position_embeddings.weight",), ("transformer.wpe.weight",)),
    _ln("input_layernorm", "self_attention.linear_qkv", _H + "ln_1", "weight"),
    _ln("input_layernorm", "self_attention.linear_qkv", _H + "ln_1", "bias"),
    MappedWeight((_LAYER + "self_attention.linear_qkv.weight",), (_H + "attn.c_attn.weight",), fused="c_attn"),
    MappedWeight((_LAYER + "self_attention.linear_qkv.bias",), (_H + "attn.c_attn.bias",), fused="c_attn", optional_bias=True),
    MappedWeight((_LAYER + "self_attention.linear_proj.weight",), (_H + "attn.c_proj.weight",), fused="conv1d"),
    MappedWeight((_LAYER + "self_attention.linear_proj.bias",), (_H + "attn.c_proj.bias",), optional_bias=True),
    _ln("pre_mlp_layernorm", "mlp.linear_fc1", _H + "ln_2", "weight"),
    _ln("pre_mlp_layernorm", "mlp.linear_fc1", _H + "ln_2", "bias"),
    MappedWeight((_LAYER + "mlp.linear_fc1.weight",), (_H + "mlp.c_fc.weight",), fused="conv1d"),
    MappedWeight((_LAYER + "mlp.linear_fc1.bias",), (_H + "mlp.c_fc.bias",), optional_bias=True),
    MappedWeight((_LAYER + "mlp.linear_fc2.weight",), (_H + "mlp.c_proj.weight",), fused="conv1d"),
    MappedWeight((_LAYER + "mlp.linear_fc2.bias",), (_H + "mlp.c_proj.bias",), optional_bias=True),
    MappedWeight(("decoder.final_layernorm.weight",), ("transformer.ln_f.weight",), norm=True),
    MappedWeight(("decoder.final_layernorm.bias",), ("transformer.ln_f.bias",)),
    MappedWeight(("output_layer.weight",), ("lm_head.weight",), vocab=True),
)

# Mixtral (MixtralForCausalLM): Llama's attention and norms; every layer's MLP is a router over SwiGLU
# experts. Written in the hub's per-expert layout (w1 = gate, w3 = up, w2 = down), which transformers
# reads in every version (5.x fuses the experts on load). ``{e}``: the expert index; the second megatron
# name is TEGroupedMLP's.
_MOE = "model.layers.{i}.block_sparse_moe."
MIXTRAL_MAP: Tuple[MappedWeight, ...] = WEIGHT_MAP[:5] + (
    MappedWeight((_LAYER + "mlp.router.weight",), (_MOE + "gate.weight",)),
    MappedWeight((_LAYER + "mlp.experts.local_experts.{e}.linear_fc1.weight", _LAYER + "mlp.experts.linear_fc1.weight{e}"),
                 (_MOE + "experts.{e}.w1.weight", _MOE + "experts.{e}.w3.weight"), fused="fc1"),
    MappedWeight((_LAYER + "mlp.experts.local_experts.{e}.linear_fc2.weight", _LAYER + "mlp.experts.linear_fc2.weight{e}"),
                 (_MOE + "experts.{e}.w2.weight",)),
) + WEIGHT_MAP[-2:]

WEIGHT_MAPS = {"LlamaForCausalLM": WEIGHT_MAP, "GPT2LMHeadModel": GPT2_MAP, "MixtralForCausalLM": MIXTRAL_MAP}
"""The weight map of each Hugging Face class the export writes (the import reads Llama's)."""


def mapped_names(num_layers: int, tied: bool, weight_map: Tuple[MappedWeight, ...] = WEIGHT_MAP,
                 num_experts: int = 0) -> Iterator[Tuple[MappedWeight, Tuple[str, ...], Tuple[str, ...]]]:
    """(entry, megatron names, HF names) with the layer (and expert) index filled in, in HF order; a tied
    model has no ``lm_head``."""
    for entry in weight_map:
        if tied and entry.hf[0] == OUTPUT.hf[0]:
            continue
        layers = range(num_layers) if "{i}" in entry.hf[0] else [None]
        experts = range(num_experts) if "{e}" in entry.hf[0] else [None]
        for i in layers:
            for e in experts:
                fmt = lambda n: n.format(i=i, e=e)  # noqa: E731 (names without a field are unchanged)
                yield entry, tuple(map(fmt, entry.megatron)), tuple(map(fmt, entry.hf))


_HF_LOCK = threading.Lock()


def parse_size(size) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "2GiB"."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ConversionError(f"--max-shard-size {size!r}: expected a size like 5GB or 500MB")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * mult)


# ---------------------------------------------------------------------------------------- checks


def check_hf_compatible(model: ModelRunConfig) -> str:
    """The Hugging Face class that computes what the saved model (``RunConfig.model`` of its saved arguments:
    a setting the file lacks is the flag's default) computes: ``LlamaForCausalLM`` (RMSNorm, SwiGLU, RoPE,
    no biases), ``GPT2LMHeadModel`` (LayerNorm, GeLU, learned positions, biases or none) or
    ``MixtralForCausalLM`` (Llama's layers with a mixture of experts in every layer). Else ConversionError,
    one line naming the setting that has no equivalent. A zero-centred norm (``--apply-layernorm-1p``)
    maps to each of them (its 1 is added to the weights)."""
    if model.input_embedding not in INPUT_EMBEDDINGS:
        raise ConversionError(f"cannot export to Hugging Face: --input-embedding {model.input_embedding} "
                              "(unknown input arm)")
    if model.mtp_num_layers:
        raise ConversionError(f"cannot export to Hugging Face: --mtp-num-layers {model.mtp_num_layers} (the "
                              "multi-token prediction block has no place in the Llama, GPT-2 or Mixtral classes)")
    if model.normalization == "LayerNorm" and not model.swiglu and not model.num_experts:
        return _check_gpt2(model)
    return _check_llama(model)


def _check_llama(model: ModelRunConfig) -> str:
    cls = "MixtralForCausalLM" if model.num_experts else "LlamaForCausalLM"

    def refuse(setting: str, why: str) -> None:
        gpt2 = "" if model.num_experts else "; GPT-2 (LayerNorm, GeLU, learned positions) is the other class written"
        raise ConversionError(f"cannot export to Hugging Face {cls.replace('ForCausalLM', '')}: {setting} ({why}{gpt2})")

    if model.normalization != "RMSNorm":
        refuse(f"--normalization {model.normalization}", f"{cls} uses RMSNorm; train with --normalization RMSNorm")
    if not model.swiglu:
        refuse("GeLU MLP (--swiglu not set)", f"{cls}'s MLP is SwiGLU")
    if not model.disable_bias_linear:
        refuse("linear-layer biases (--disable-bias-linear not set)", f"{cls} has no biases")
    if model.position_embedding_type != "rope":
        refuse(f"--position-embedding-type {model.position_embedding_type}", f"{cls} uses RoPE")
    if float(model.rotary_percent) != 1.0:
        refuse(f"--rotary-percent {model.rotary_percent}", f"{cls} rotates every channel of a head")
    if model.num_experts:
        freq = model.moe_layer_freq
        if not (freq == 1 or (isinstance(freq, list) and all(int(x) == 1 for x in freq))):
            refuse(f"--moe-layer-freq {freq}", "every Mixtral layer is a mixture of experts")
    return cls


def _check_gpt2(model: ModelRunConfig) -> str:
    def refuse(setting: str, why: str) -> None:
        raise ConversionError(f"cannot export to Hugging Face GPT-2 (LayerNorm, GeLU): {setting} ({why})")

    if model.position_embedding_type != "learned_absolute":
        refuse(f"--position-embedding-type {model.position_embedding_type}",
               "GPT-2 has learned absolute positions; only RMSNorm + SwiGLU models export with RoPE, as Llama")
    n, g, hd = head_layout(model)
    if g != n:
        refuse(f"--num-query-groups {g}", "GPT-2 has one key/value head per query head")
    if hd * n != int(model.hidden_size):
        refuse(f"--kv-channels {hd}", f"GPT-2's heads have hidden-size / heads = {int(model.hidden_size) // n} channels")
    return "GPT2LMHeadModel"


def head_layout(shape) -> Tuple[int, int, int]:
    """(num_heads, num_query_groups, head_dim) of ``shape``: a TransformerConfig, the saved model
    (``ModelRunConfig``) or a Hugging Face config's :class:`LlamaShape` (unset groups: one per head; unset
    channels: hidden / heads)."""
    n = int(shape.num_attention_heads)
    g = int(shape.num_query_groups or n)
    hd = int(shape.kv_channels or (int(shape.hidden_size) // n))
    return n, g, hd


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions the weight map reads, under TransformerConfig's names (a Hugging Face config's)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Hidden width."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads."""
    kv_channels: int
    """Channels per head."""


# ------------------------------------------------------------------------------------ tensor map


def split_qkv(w, n: int, g: int, hd: int):
    """megatron's fused ``linear_qkv`` [g*(n/g+2)*hd, D] -> (q [n*hd, D], k [g*hd, D], v [g*hd, D])."""
    per = n // g
    d_in = w.shape[-1]
    if w.shape[0] != g * (per + 2) * hd:
        raise ConversionError(f"linear_qkv has {w.shape[0]} rows; expected {g}*({per}+2)*{hd} "
                              "(num_query_groups / kv_channels in the config do not match the weights)")
    w = w.reshape(g, per + 2, hd, d_in)
    q = w[:, :per].reshape(n * hd, d_in)
    k = w[:, per].reshape(g * hd, d_in)
    v = w[:, per + 1].reshape(g * hd, d_in)
    return q.contiguous(), k.contiguous(), v.contiguous()


def split_fc1(w):
    """megatron's SwiGLU ``linear_fc1`` [2F, D] = [gate; up] -> (gate, up)."""
    f = w.shape[0] // 2
    return w[:f].contiguous(), w[f:].contiguous()


def join_qkv(q, k, v, n: int, g: int, hd: int):
    """Inverse of :func:`split_qkv`: (q [n*hd, D], k [g*hd, D], v [g*hd, D]) -> megatron's fused rows."""
    import torch

    per, d_in = n // g, q.shape[-1]
    return torch.cat([q.reshape(g, per, hd, d_in), k.reshape(g, 1, hd, d_in), v.reshape(g, 1, hd, d_in)],
                     dim=1).reshape(g * (per + 2) * hd, d_in)


def join_fc1(gate, up):
    """Inverse of :func:`split_fc1`."""
    import torch

    return torch.cat([gate, up], dim=0)


def _split(entry: MappedWeight, w, shape):
    if entry.fused == "qkv":
        return split_qkv(w, *head_layout(shape))
    if entry.fused == "fc1":
        return split_fc1(w)
    if entry.fused == "c_attn":  # [q | k | v] along GPT-2's output dimension (Conv1D: [in, out])
        import torch

        parts = split_qkv(w if w.dim() == 2 else w[:, None], *head_layout(shape))
        joined = torch.cat(parts, dim=0)
        return (joined.t().contiguous() if w.dim() == 2 else joined[:, 0].contiguous(),)
    if entry.fused == "conv1d":
        return (w.t().contiguous(),)
    return (w,)


def _join(entry: MappedWeight, parts, shape):
    if entry.fused == "qkv":
        return join_qkv(*parts, *head_layout(shape))
    if entry.fused == "fc1":
        return join_fc1(*parts)
    return parts[0]


def _is_input_table(entry: MappedWeight) -> bool:
    return entry.vocab and entry.hf[0] != OUTPUT.hf[0]


def hf_tensors(state_dict: Dict[str, Any], shape, input_table=None, vocab_rows: Optional[int] = None,
               tied: bool = False, weight_map: Tuple[MappedWeight, ...] = WEIGHT_MAP, num_experts: int = 0,
               zero_centered_gamma: bool = False) -> Iterator[Tuple[str, Any]]:
    """(HF name, tensor) pairs for a TP=1 megatron-core state dict of a model of ``shape`` (its
    TransformerConfig, :func:`head_layout`), in HF order of ``weight_map`` (:data:`WEIGHT_MAPS`).

    ``input_table``: the dense [V, D] input table (materialised arm); when None, the state dict's
    ``embedding.word_embeddings.weight`` is used. ``vocab_rows``: keep this many vocabulary rows.
    ``tied``: write no ``lm_head`` (HF ties it to the input table). ``num_experts``: experts per layer
    (Mixtral). ``zero_centered_gamma``: megatron stores the norms' scale minus 1 (``--apply-layernorm-1p``);
    the 1 is added."""
    cls = next((k for k, v in WEIGHT_MAPS.items() if v is weight_map), "Llama").replace("ForCausalLM", "")
    used = set(k for k in state_dict if k.startswith("embedding.word_embeddings") or k.startswith("embedding.arm.")) \
        if input_table is not None else set()
    if tied:
        used.add(OUTPUT.megatron[0])
    for entry, meg, hf in mapped_names(int(shape.num_layers), tied, weight_map, num_experts):
        if _is_input_table(entry) and input_table is not None:
            w = input_table
        else:
            name = next((m for m in meg if m in state_dict), None)
            weight = meg[0][:-len("bias")] + "weight"
            if name is None and entry.optional_bias and weight in state_dict:  # --disable-bias-linear
                w = state_dict[weight].new_zeros(state_dict[weight].shape[0])
            elif name is None:
                if _is_input_table(entry):
                    raise ConversionError("the model has neither a word-embedding table nor a materialised input arm")
                raise ConversionError(f"cannot export to Hugging Face {cls}: megatron parameter {meg[0]} is missing")
            else:
                used.add(name)
                w = state_dict[name].detach()
                if entry.norm and zero_centered_gamma:
                    w = w + 1
        if entry.vocab and vocab_rows is not None:
            w = w[:vocab_rows]
        yield from zip(hf, _split(entry, w, shape))
    left = [k for k in state_dict if k not in used and not k.endswith("_extra_state")
            and state_dict[k] is not None and getattr(state_dict[k], "numel", lambda: 0)() > 0]
    if left:
        raise ConversionError(f"cannot export to Hugging Face {cls}: megatron parameter {left[0]} has no "
                              f"{cls} equivalent")


def megatron_tensors(get: Callable[[str], Any], shape, model_keys: Iterable[str], tied: bool,
                     vocab_rows: int) -> Iterator[Tuple[str, Any]]:
    """(megatron name, tensor) pairs for a TP=1 model of ``shape`` (:func:`head_layout`) whose state-dict
    names are ``model_keys``, from HF
    tensors read by ``get(hf_name)`` (:data:`WEIGHT_MAP` read backwards). Vocabulary matrices are padded
    with zero rows to ``vocab_rows``. Every model key is produced once, or ConversionError names it."""
    import torch

    keys = set(model_keys)
    done = set()
    for entry, meg, hf in mapped_names(int(shape.num_layers), tied):
        name = next((m for m in meg if m in keys), None)
        if name is None:
            raise ConversionError(f"the megatron model has no parameter for {hf[0]} (expected {meg[0]})")
        w = _join(entry, [get(h) for h in hf], shape)
        if entry.vocab and w.shape[0] < vocab_rows:
            w = torch.cat([w, w.new_zeros(vocab_rows - w.shape[0], *w.shape[1:])])
        done.add(name)
        yield name, w
    if tied and OUTPUT.megatron[0] in keys:  # a copy of the embedding on a last stage
        done.add(OUTPUT.megatron[0])
    left = sorted(k for k in keys - done if not k.endswith("_extra_state"))
    if left:
        raise ConversionError(f"the megatron model's parameter {left[0]} has no Hugging Face Llama equivalent")


class ShardedSafetensorsWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_size`` bytes as they come.

    One shard -> ``model.safetensors``; several -> ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json`` (HF's layout)."""

    def __init__(self, out_dir: str, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, dtype=None) -> None:
        self.out_dir = out_dir
        self.max = int(max_shard_size)
        self.dtype = dtype
        self._buf: Dict[str, Any] = {}
        self._buf_bytes = 0
        self._shards: List[Tuple[str, List[str]]] = []
        self.total_size = 0

    def add(self, name: str, tensor) -> None:
        if self.dtype is not None:
            tensor = tensor.to(self.dtype)
        tensor = tensor.detach().contiguous().clone()  # own storage: no views of the model's parameters
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max:
            self._flush()
        self._buf[name] = tensor
        self._buf_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        from .files import save_safetensors

        tmp = os.path.join(self.out_dir, f".shard-{len(self._shards):05d}.safetensors")
        save_safetensors(self._buf, tmp)
        self._shards.append((tmp, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> List[str]:
        if self._buf or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            final = os.path.join(self.out_dir, "model.safetensors")
            os.replace(self._shards[0][0], final)
            return [final]
        weight_map, files = {}, []
        for i, (tmp, names) in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.out_dir, name))
            files.append(os.path.join(self.out_dir, name))
            weight_map.update({k: name for k in names})
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total_size}, "weight_map": weight_map}, f, indent=2,
                      sort_keys=True)
        return files


# ------------------------------------------------------------------------------ config/tokenizer


def tokenizer_info(a) -> Optional[Dict[str, Any]]:
    """Vocabulary size and special ids of the checkpoint's tokenizer (None when it cannot be built); ``a``:
    what ``TokenizerSpec.from_args`` reads (the saved run's ``data`` group, or saved arguments)."""
    spec = TokenizerSpec.from_args(a)
    if spec is None:
        return None
    t = spec.tokenizer_type
    try:
        tok = spec.build()
    except Exception as e:  # the export goes on without tokenizer files, but says why
        print(f"warning: the checkpoint's tokenizer ({t}) could not be loaded, so no tokenizer files are "
              f"exported: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return None
    bos = getattr(tok, "bos", None)
    return {"type": t, "vocab_size": int(tok.vocab_size), "eod": int(tok.eod),
            "bos": int(bos) if isinstance(bos, int) and bos >= 0 else None}


def export_tokenizer(spec: Optional[TokenizerSpec], out_dir: str, log=print,
                     special: Optional[Dict[str, Any]] = None) -> List[str]:
    """Write the checkpoint's tokenizer (``spec``) in HF form (or copy its files); return the written names.
    ``special`` (``tokenizer_info``): its end-of-document id becomes the eos and pad token, its bos id (else
    eos) the bos token, where the tokenizer names none (lm-eval's ``hf`` model and ``generate`` read them)."""
    t = spec.tokenizer_type if spec is not None else None
    before = set(os.listdir(out_dir))
    if t in (None, "NullTokenizer"):
        return []
    try:
        tok = None
        if t == "GPT2BPETokenizer":
            from transformers import GPT2TokenizerFast

            special_kw = dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")
            tok = GPT2TokenizerFast(vocab=spec.vocab_file, merges=spec.merge_file, **special_kw)
            if len(tok) < 1000:  # transformers < 5 names the files vocab_file / merges_file
                tok = GPT2TokenizerFast(vocab_file=spec.vocab_file, merges_file=spec.merge_file, **special_kw)
        elif t == "HuggingFaceTokenizer":
            path = spec.tokenizer_model
            if os.path.isdir(path):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(path)
            else:
                from transformers import PreTrainedTokenizerFast

                tok = PreTrainedTokenizerFast(tokenizer_file=path)
        elif t in SENTENCEPIECE_TYPES:
            shutil.copy(spec.tokenizer_model, os.path.join(out_dir, "tokenizer.model"))
            try:
                from transformers import LlamaTokenizer

                tok = LlamaTokenizer(vocab_file=spec.tokenizer_model, add_bos_token=False, legacy=False)
            except Exception as e:  # keep the raw model file
                log(f"WARNING: SentencePiece model copied as tokenizer.model but not converted ({e})")
        else:  # TikTokenizer: no HF class reads its file
            shutil.copy(spec.tokenizer_model, out_dir)
            log(f"WARNING: --tokenizer-type {t}: its file was copied; transformers cannot load it directly")
        if tok is not None:
            _name_special_tokens(tok, special)
            tok.save_pretrained(out_dir)
    except (OSError, KeyError, TypeError, ValueError) as e:
        log(f"WARNING: tokenizer not exported ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return sorted(set(os.listdir(out_dir)) - before)


def _name_special_tokens(tok, special: Optional[Dict[str, Any]]) -> None:
    """eos = pad = the end-of-document token, bos = the tokenizer's bos (else eos), where ``tok`` has none."""
    bos, eos = _special_ids(special)
    for attr, i in (("eos_token", eos), ("bos_token", bos), ("pad_token", eos)):
        if i is not None and getattr(tok, attr, None) is None and 0 <= i < len(tok):
            setattr(tok, attr, tok.convert_ids_to_tokens(int(i)))


def _special_ids(tok: Optional[Dict[str, Any]]) -> Tuple[Optional[int], Optional[int]]:
    """(bos, eos) ids of the checkpoint's tokenizer (``tokenizer_info``): eos is the end-of-document id,
    bos the tokenizer's own or eos."""
    eos = tok["eod"] if tok else None
    return (tok["bos"] if tok and tok["bos"] is not None else eos), eos


def hf_config(cls: str, rc: RunConfig, vocab_size: int, dtype: str, tok: Optional[Dict[str, Any]]):
    """The config of the Hugging Face class ``cls`` (:func:`check_hf_compatible`) for the saved run ``rc``
    with ``vocab_size`` rows."""
    import transformers

    m = rc.model
    n, g, hd = head_layout(m)
    bos, eos = _special_ids(tok)
    common = dict(vocab_size=int(vocab_size), initializer_range=float(m.init_method_std),
                  tie_word_embeddings=get_arm(m.input_embedding).ties_output_head, bos_token_id=bos, eos_token_id=eos,
                  pad_token_id=None, architectures=[cls])
    max_pos = int(m.max_position_embeddings or rc.data.seq_length)
    if cls == "GPT2LMHeadModel":
        # activation "gelu" is torch's exact GeLU, megatron's activation_func; dropouts as trained.
        cfg = transformers.GPT2Config(
            n_embd=int(m.hidden_size), n_layer=int(m.num_layers), n_head=n, n_inner=int(m.ffn_hidden_size),
            n_positions=max_pos, activation_function="gelu", layer_norm_epsilon=float(m.norm_epsilon),
            resid_pdrop=float(m.hidden_dropout), embd_pdrop=float(m.hidden_dropout),
            attn_pdrop=float(m.attention_dropout), scale_attn_weights=True, **common)
    else:
        llama = dict(hidden_size=int(m.hidden_size), num_hidden_layers=int(m.num_layers), num_attention_heads=n,
                     num_key_value_heads=g, head_dim=hd, hidden_act="silu", max_position_embeddings=max_pos,
                     rms_norm_eps=float(m.norm_epsilon), rope_theta=float(m.rotary_base), attention_bias=False,
                     **common)
        if m.use_rope_scaling:  # megatron-core's Llama-3.1 scaling: only the factor is a setting
            llama["rope_scaling"] = {"rope_type": "llama3", "factor": float(m.rope_scaling_factor), **LLAMA3_ROPE}
        if cls == "MixtralForCausalLM":
            cfg = transformers.MixtralConfig(
                intermediate_size=int(m.moe_ffn_hidden_size or m.ffn_hidden_size), num_local_experts=int(m.num_experts),
                num_experts_per_tok=int(m.moe_router_topk), router_jitter_noise=0.0, sliding_window=None,
                router_aux_loss_coef=float(m.moe_aux_loss_coeff or 0.0), **llama)
        else:
            cfg = transformers.LlamaConfig(intermediate_size=int(m.ffn_hidden_size), mlp_bias=False, **llama)
    if hasattr(cfg, "dtype"):
        cfg.dtype = dtype
    else:  # transformers < 5
        cfg.torch_dtype = dtype
    return cfg


def llama_config(rc: RunConfig, vocab_size: int, dtype: str, tok: Optional[Dict[str, Any]]):
    """The ``LlamaConfig`` of the saved run ``rc`` with ``vocab_size`` rows."""
    return hf_config("LlamaForCausalLM", rc, vocab_size, dtype, tok)


# ------------------------------------------------------------------------------------- the run


def _export_rank(src_path: str, out_dir: str, a: Dict[str, Any], opts: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    from megatron_lev.models import materialize_input_embedding

    from .model_io import build_model, load_model_weights

    progress = opts["progress"]
    log = print if progress else (lambda m: None)
    chunks, config, model_config = build_model(a)
    model = chunks[0]
    log(f"  loading {src_path}")
    load_model_weights(chunks, src_path, log=log)
    arm = model_config.arm
    dtype = getattr(torch, opts["dtype"])
    table = None
    if not arm.megatron_embedding:
        log(f"  materialising the {arm.name} input layer over {model_config.vocab_size} ids")
        table = materialize_input_embedding(model)
    state = model.state_dict()
    vocab_rows = opts.get("vocab_rows")
    weight_map, experts = WEIGHT_MAPS[opts["hf_class"]], int(config.num_moe_experts or 0)
    total = sum(len(hf) for _e, _m, hf in mapped_names(int(config.num_layers), arm.ties_output_head, weight_map, experts))
    writer = ShardedSafetensorsWriter(out_dir, opts["max_shard_size"], dtype=dtype)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="writing safetensors", unit="tensor", disable=not progress)
    for name, tensor in hf_tensors(state, config, input_table=table, vocab_rows=vocab_rows, tied=arm.ties_output_head,
                                   weight_map=weight_map, num_experts=experts,
                                   zero_centered_gamma=bool(config.layernorm_zero_centered_gamma)):
        writer.add(name, tensor)
        bar.update(1)
    bar.close()
    files = writer.close()
    result: Dict[str, Any] = {"files": [os.path.basename(f) for f in files], "total_size": writer.total_size}
    if arm.lev_layer and opts.get("lev", True):
        from .lev_export import write_lev

        write_lev(model, config, model_config, opts["iteration"], os.path.join(out_dir, "lev"), table=table)
        result["lev"] = True
    ids = opts.get("reference_ids")
    if ids is not None:
        result["logits"] = megatron_logits(model, torch.as_tensor(ids)).numpy()
    return result


def megatron_logits(model, ids):
    """Logits [b, s, V] of a TP=1, PP=1 model for token ids [b, s] (fp32, eval mode, no mask: causal)."""
    import torch

    ids = ids.long()
    if ids.dim() == 1:
        ids = ids[None]
    pos = torch.arange(ids.shape[1], dtype=torch.long).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        out = model(ids, pos, None)
    return out.float().cpu()


def resolve_dtype(dtype: Optional[str], trained: str) -> str:
    """The export's dtype: ``dtype`` (--dtype), else the ``trained`` one (``params_dtype_name``)."""
    name = dtype if dtype is not None else trained
    if name not in _DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: choose float32, bfloat16 or float16")
    return _DTYPES[name]


def export_hf(src: str, out_dir: str, *, iteration: Optional[int] = None, dtype: Optional[str] = None,
              max_shard_size=DEFAULT_MAX_SHARD_SIZE, trim_vocab: bool = False, tokenizer: bool = True,
              lev: bool = True, overwrite: bool = False, progress: bool = True,
              reference_ids=None, allow_missing_checksums: bool = False) -> Dict[str, Any]:
    """Export the checkpoint at ``src`` as a Hugging Face directory ``out_dir`` of the class that computes it
    (:func:`check_hf_compatible`: Llama, GPT-2 or Mixtral; ``result["hf_class"]``).

    ``dtype``: float32/bfloat16/float16 (default: the training dtype). ``trim_vocab``: keep only the
    tokenizer's ids (default: keep the padded vocabulary). ``tokenizer``: write the tokenizer files
    when the checkpoint names a tokenizer whose files exist. ``lev``: for the lev arm, also write
    ``out_dir/lev`` (the LEV parameters and config). ``reference_ids`` ([b, s] ints): also return the
    megatron model's logits for them (``result["logits"]``, numpy) to check the export.
    Returns a summary dict (files, sizes, vocab size, tokenizer files)."""
    from .launch import run_ranks
    from .model_io import layout_args

    out_dir = os.path.abspath(os.path.expanduser(str(out_dir)))
    check_writable(out_dir)  # before any work
    source = open_checkpoint(src, iteration, allow_missing_checksums=allow_missing_checksums)
    rc = saved_config(source)
    hf_class = check_hf_compatible(rc.model)
    dt = resolve_dtype(dtype, rc.model.params_dtype_name)
    shard = parse_size(max_shard_size)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConversionError(f"{out_dir}: exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConversionError(f"{out_dir}: not empty; choose an empty --save directory (or --overwrite)")
    spec = TokenizerSpec.from_args(rc.data)
    with _HF_LOCK:
        tok = tokenizer_info(rc.data)
    padded = int(rc.model.padded_vocab_size)
    vocab_rows = None
    if trim_vocab:
        if tok is None:
            raise ConversionError("--trim-vocab needs the checkpoint's tokenizer (its files were not found)")
        if tok["vocab_size"] > padded:
            raise ConversionError(f"tokenizer has {tok['vocab_size']} ids but the model only {padded} rows")
        vocab_rows = tok["vocab_size"]
    os.makedirs(out_dir, exist_ok=True)
    if overwrite:
        from .files import clear_export_dir

        clear_export_dir(out_dir)
    if progress:
        print(f"exporting {source.path} ({rc.model.input_embedding}, iteration {source.iteration}) -> {out_dir} "
              f"as {hf_class} ({dt})", flush=True)
    a1 = layout_args(source.args, 1, 1)
    opts = {"hf_class": hf_class, "dtype": dt, "max_shard_size": shard, "vocab_rows": vocab_rows, "progress": progress, "lev": lev,
            "iteration": source.iteration,
            "reference_ids": None if reference_ids is None else [list(map(int, r)) for r in reference_ids]}
    with disk_full_is_one_line(out_dir, "the Hugging Face export"):
        result = run_ranks(_export_rank, tp=1, pp=1, args=(source.path, out_dir, a1, opts))[0]
        vocab = vocab_rows if vocab_rows is not None else padded
        with _HF_LOCK:  # transformers' lazy imports are not thread-safe (exports may run side by side)
            hf_config(hf_class, rc, vocab, dt, tok).save_pretrained(out_dir)
            from transformers import GenerationConfig

            bos, eos = _special_ids(tok)
            GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(out_dir)
            result["tokenizer_files"] = export_tokenizer(spec, out_dir, log=print if progress else (lambda m: None),
                                                         special=tok) if tokenizer else []
            if result["tokenizer_files"] and rc.data.tokenizer_fingerprint:
                # What evaluation compares an indexed set with (re-saved files hash differently).
                write_sidecar(os.path.join(out_dir, MODEL_DIR_SIDECAR), rc.data.tokenizer_fingerprint)
                result["tokenizer_files"].append(MODEL_DIR_SIDECAR)
    result.update(hf_class=hf_class, vocab_size=vocab, padded_vocab_size=padded, dtype=dt, out_dir=out_dir,
                  tokenizer_vocab_size=tok["vocab_size"] if tok else None)
    if progress:
        print(f"done: {out_dir} ({len(result['files'])} safetensors file(s), {result['total_size'] / 2**20:.1f} MiB, "
              f"vocab {vocab}{' (padded)' if vocab_rows is None and tok and tok['vocab_size'] != vocab else ''})",
              flush=True)
    return result
