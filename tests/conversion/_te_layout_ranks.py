"""Rank-side helpers of the layer-spec layout tests (module level: run_distributed spawns fresh processes).

``te_block_keys`` derives the checkpoint keys of megatron-core's Transformer Engine layer spec without
Transformer Engine: the TE wrapper module of megatron-core is replaced by named placeholders, so
megatron-core's real ``TESpecProvider`` and ``get_gpt_layer_with_transformer_engine_spec`` (through this
project's ``get_block_spec``) build the spec tree, which is walked instead of instantiated. The one
thing taken from TE itself is the parameter names of its modules (``TE_PARAMS``).

``write_layouts`` writes, from a checkpoint of the local spec, the same weights as Transformer Engine
writes them (extra ``_extra_state`` objects with FP8 metadata for every TE module, the run's settings
saying transformer_engine + FP8) and as versions before the TE key names wrote them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import pickle
import sys
import types
from typing import Dict, Set, Tuple

import torch

TE_MODULES = ("TEActivationOp", "TEColumnParallelGroupedLinear", "TEColumnParallelLinear", "TEDotProductAttention",
              "TELayerNormColumnParallelLinear", "TELinear", "TENorm", "TERowParallelGroupedLinear",
              "TERowParallelLinear")


def TE_PARAMS(name: str, config) -> list:
    """Parameter names of a Transformer Engine module (TE's API: LayerNormLinear prefixes its norm's)."""
    norm = ["weight"] + (["bias"] if config.normalization == "LayerNorm" else [])
    linear = ["weight"] + (["bias"] if config.add_bias_linear else [])
    return {"TELayerNormColumnParallelLinear": linear + [f"layer_norm_{n}" for n in norm],
            "TEColumnParallelLinear": linear, "TERowParallelLinear": linear, "TELinear": linear,
            "TENorm": norm, "TEDotProductAttention": []}[name]


@contextlib.contextmanager
def _te_placeholders():
    """megatron-core's TE wrapper module as named placeholder classes, and megatron-core's TESpecProvider
    on top of them, while the block is specified (models are built without them)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_lev.models import specs

    wrappers, provider_name = "megatron.core.extensions.transformer_engine", \
        "megatron.core.extensions.transformer_engine_spec_provider"
    stub = types.ModuleType(wrappers)
    for cls in TE_MODULES:
        setattr(stub, cls, type(cls, (), {"te_placeholder": True}))
    saved = {n: sys.modules.pop(n, None) for n in (wrappers, provider_name)}
    use_te, real_provider = specs.use_transformer_engine, getattr(gpt_layer_specs, "TESpecProvider", None)
    sys.modules[wrappers] = stub
    try:
        provider = importlib.import_module(provider_name)  # fresh: bound to the placeholders
        provider.is_te_min_version = lambda *a, **k: True  # a current Transformer Engine
        gpt_layer_specs.TESpecProvider = provider.TESpecProvider
        specs.use_transformer_engine = lambda impl: impl == "transformer_engine"
        yield
    finally:
        specs.use_transformer_engine = use_te
        if real_provider is None:
            del gpt_layer_specs.TESpecProvider
        else:
            gpt_layer_specs.TESpecProvider = real_provider
        for n, module in saved.items():
            sys.modules.pop(n, None)
            if module is not None:
                sys.modules[n] = module


def te_block_keys(config, model_config) -> Tuple[Set[str], Set[str]]:
    """(parameter keys, ``_extra_state`` keys) that this project's TE block spec saves under ``decoder.``."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_lev.models import specs

    with _te_placeholders():
        block = specs.get_block_spec(config, dataclasses.replace(model_config, transformer_impl="transformer_engine"))
    params, extra = set(), set()

    def walk(spec, prefix: str, keys_map: Dict[str, str]) -> None:
        if isinstance(spec, functools.partial):
            # megatron-core 0.19 gives the MLP as partial(MLP.as_mlp_submodule, submodules=...)
            module = getattr(spec.func, "__self__", spec.func)
            sub = spec.keywords.get("submodules")
        else:
            module, sub = (spec.module, spec.submodules) if isinstance(spec, ModuleSpec) else (spec, None)
        if not isinstance(module, type) or issubclass(module, (IdentityOp, IdentityFuncOp)):
            return  # bias-dropout-add functions, disabled norms and cross-attention
        if getattr(module, "te_placeholder", False):
            for name in TE_PARAMS(module.__name__, config):
                key = prefix + name
                for old, new in keys_map.items():  # the TE spec's own renames (TE op-fuser MLP)
                    key = key.replace(old, new, 1) if key.startswith(old) else key
                params.add(key)
            extra.add(prefix + "_extra_state")
            return
        assert sub is not None, f"{prefix}: {module.__name__} is not a Transformer Engine module"
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            if isinstance(value, (ModuleSpec, type, functools.partial)):
                walk(value, f"{prefix}{f.name}.", keys_map)

    assert len({id(s) for s in block.layer_specs}) == 1
    layer = block.layer_specs[0]
    walk(layer, "", {})
    km = layer.submodules.sharded_state_dict_keys_map
    params = {_mapped(k, km) for k in params}
    params = {f"decoder.layers.{k}" for k in params}
    extra = {f"decoder.layers.{k}" for k in extra}
    walk(block.layer_norm, "decoder.final_layernorm.", {})
    return params, extra


def _mapped(key: str, keys_map: Dict[str, str]) -> str:
    for old, new in keys_map.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def sharded_keys(model) -> Tuple[Set[str], Set[str]]:
    """(tensor keys, object keys) of ``model``'s sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = model.sharded_state_dict()
    objects = {v.key for v in sd.values() if isinstance(v, ShardedObject)}
    return {v.key for v in sd.values() if not isinstance(v, ShardedObject)}, objects


def _args_for(src, **changes):
    """The checkpoint ``src``'s configuration at TP=1, PP=1 with ``changes`` (saved names) over it."""
    from megatron_lev.config.saved import SavedConfig
    from megatron_lev.conversion.model_io import layout_args

    return SavedConfig.read(dict(layout_args(src.config(), 1, 1).to_saved_args(), **changes))


def compare_keys(src_path: str):
    """For the checkpoint's model and a LayerNorm + biases + q/k-norm variant: the local model's
    sharded keys and the TE spec's, derived from megatron-core's spec."""
    from megatron_lev.conversion.model_io import build_model
    from megatron_lev.conversion.source import open_checkpoint

    src = open_checkpoint(src_path)
    out = {}
    for name, changes in (("llama", {}),
                          ("layernorm_bias_qknorm", {"normalization": "LayerNorm", "disable_bias_linear": False,
                                                     "swiglu": False})):
        chunks, config, model_config = build_model(_args_for(src, **changes))
        if name != "llama":  # q/k norms: a TransformerConfig setting (no command-line flag)
            from megatron_lev.models import build_gpt_model

            config = dataclasses.replace(config, qk_layernorm=True)
            chunks = [build_gpt_model(config=config, model_config=model_config)]
        tensors, objects = sharded_keys(chunks[0])
        te_params, te_extra = te_block_keys(config, model_config)
        out[name] = {"local": tensors, "local_objects": objects, "te_params": te_params, "te_extra": te_extra}
    return out


def _fp8_meta() -> torch.Tensor:
    """An ``_extra_state`` as Transformer Engine serialises it: pickled FP8 metadata in a uint8 tensor."""
    meta = {"recipe": "DelayedScaling(hybrid)", "scale_fwd": torch.ones(3), "amax_history_fwd": torch.rand(16, 3),
            "scale_bwd": torch.ones(2), "amax_history_bwd": torch.rand(16, 2), "global_fp8_buffer_pos_fwd": 0}
    return torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)


class _Chunk:
    """A model chunk whose sharded state dict is given (what ``save_checkpoint`` asks of a chunk)."""

    def __init__(self, sd):
        self._sd = sd

    def sharded_state_dict(self):
        return self._sd


def _save(model_sd, src, dst_root: str, settings: Dict) -> str:
    from megatron_lev import checkpoint

    common = src.common
    return checkpoint.save_checkpoint(
        dst_root, src.iteration, [_Chunk(model_sd)], None, None,
        consumed_train_samples=int(common.get("consumed_train_samples", 0)), counters=dict(common.get("counters", {})),
        config=dict(src.args, **settings), save_optim=False, log=lambda m: None)


def write_layouts(src_path: str, te_root: str, old_root: str, te_extra: Set[str]) -> Dict[str, int]:
    """The checkpoint at ``src_path`` (local spec) rewritten as Transformer Engine writes it (every TE
    module's ``_extra_state`` holding FP8 metadata) and as the local spec wrote it before it used TE's
    key names. Returns the number of TE extra-state objects written."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    from megatron_lev.conversion.model_io import build_model, load_model_weights
    from megatron_lev.conversion.source import open_checkpoint
    from megatron_lev.models import specs

    src = open_checkpoint(src_path)
    a = _args_for(src)
    chunks, config, _mc = build_model(a)
    load_model_weights(chunks, src.path)
    model = chunks[0]
    sd = model.sharded_state_dict()
    n_layers = config.num_layers
    replica = (0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True))
    written = 0
    for key in sorted(te_extra):
        rest = key[len("decoder.layers."):] if key.startswith("decoder.layers.") else None
        if rest is None:
            sd[key] = make_sharded_object_for_checkpoint(_fp8_meta(), key, (), replica_id=replica)
            written += 1
            continue
        for i in range(n_layers):  # stacked layers: one object per layer, offset on the layer axis
            sd[f"decoder.layers.{i}.{rest}"] = make_sharded_object_for_checkpoint(
                _fp8_meta(), key, [(0, i, n_layers)], replica_id=replica)
            written += 1
    _save(sd, src, te_root, {"transformer_impl": "transformer_engine", "fp8_format": "hybrid"})

    # Before the TE names: the same layer without megatron-core's keys map.
    keys_map = specs.te_layer_keys_map
    specs.te_layer_keys_map = lambda: {}
    try:
        old_chunks, _c, _m = build_model(a)
    finally:
        specs.te_layer_keys_map = keys_map
    old_chunks[0].load_state_dict(model.state_dict(), strict=True)
    _save(old_chunks[0].sharded_state_dict(), src, old_root, {})
    return {"te_extra_objects": written}


FRESH_STATE = (7, 7, 7)


class _ExtraStateAttention:
    """Mixed into core attention: a module that saves ``_extra_state`` as TE's attention does."""

    def get_extra_state(self):
        return torch.tensor(FRESH_STATE, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded_extra_state = state


def load_everywhere(paths: Dict[str, str], ids, sequences):
    """Logits of each checkpoint through the conversion loader and the evaluation loader, the
    evaluation scores, and the input table of the first; then a model whose core attention requests
    ``_extra_state`` (as TE's does) loads the first checkpoint, which has none."""
    from megatron_lev.conversion.model_io import build_model, load_model_weights
    from megatron_lev.conversion.source import open_checkpoint
    from megatron_lev.evaluation.megatron_scorer import MegatronScorer
    from megatron_lev.models import materialize_input_embedding

    ids = torch.as_tensor(ids).long()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    out = {"conversion": {}, "evaluation": {}, "scores": {}, "notes": {}}

    def logits(chunks):
        with torch.no_grad():
            return chunks[0](ids, pos, None).float()

    for name, path in paths.items():
        src = open_checkpoint(path)
        notes = []
        chunks, _c, _m = build_model(_args_for(src))
        load_model_weights(chunks, src.path, log=notes.append)
        out["conversion"][name] = logits(chunks)
        out["notes"][name] = notes
        if name == "src":
            out["table"] = materialize_input_embedding(chunks[0]).detach().clone()
        eval_notes = []
        scorer, _args, _info = MegatronScorer.from_checkpoint(path, log=eval_notes.append)
        out["evaluation"][name] = logits(scorer.model)
        out["notes"][name + "_eval"] = eval_notes
        out["scores"][name] = [(s.logprobs.tolist(), s.greedy.tolist()) for s in scorer.score(sequences)]

    # The other direction on CPU: modules that request _extra_state (TE's) from a checkpoint without it.
    first = open_checkpoint(next(iter(paths.values())))
    chunks, _c, _m = build_model(_args_for(first))
    attn = [m for m in chunks[0].modules() if type(m).__name__ == "SDPAttention"]
    for m in attn:
        m.__class__ = type("TEStyleAttention", (_ExtraStateAttention, type(m)), {})
    notes = []
    load_model_weights(chunks, first.path, log=notes.append)
    out["extra_requesting"] = {"logits": logits(chunks), "notes": notes, "modules": len(attn),
                               "states": [m.loaded_extra_state.tolist() for m in attn]}
    return out


def layouts(src: str, te_root: str, old_root: str, ids, sequences):
    """One launch: the key comparison, the TE-layout and old-layout checkpoints, and loading all three."""
    from megatron_lev.models.checkpoint_keys import saved_keys

    keys = compare_keys(src)
    written = write_layouts(src, te_root, old_root, keys["llama"]["te_extra"])
    out = load_everywhere({"src": src, "te": te_root, "old": old_root}, ids, sequences)
    out.update(keys=keys, written=written, saved={name: saved_keys(_iter_dir(p)) for name, p in
                                                  (("src", src), ("te", te_root), ("old", old_root))})
    return out


def train_and_layouts(train_argv, src: str, te_root: str, old_root: str, ids, sequences):
    """``layouts`` after pretrain_lev.py's training run, both in this launch (one launch's imports):
    ``pretrain`` uses the launch's process group and sets up and tears down its own parallel state;
    the groups and the RNG tracker are then set up again as the launch had them."""
    import io

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_lev.training import pretrain

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ps.destroy_model_parallel()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        code = pretrain(list(train_argv) + ["--save", src])
    assert code == 0, f"training run: exit {code}\n{log.getvalue()[-3000:]}"
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    return layouts(src, te_root, old_root, ids, sequences)


def _iter_dir(root: str) -> str:
    from megatron_lev.conversion.source import open_checkpoint

    return open_checkpoint(root).path


def gpu_round_trip(tmp: str):
    """With Transformer Engine on a GPU: a TE-spec model (FP8 metadata in its extra state after an FP8
    step) saved with dist_checkpointing loads into the local spec, and a local-spec checkpoint loads into
    the TE spec; max |logit difference| of each direction (fp32; TE and torch kernels differ slightly)."""
    from megatron.core import dist_checkpointing

    from megatron_lev.conversion.model_io import load_model_weights
    from megatron_lev.lev.config import LEVConfig
    from megatron_lev.models import LevModelConfig, build_gpt_model, build_transformer_config

    def build(impl: str, fp8=None):
        mc = LevModelConfig(vocab_size=1024, max_sequence_length=32, input_embedding="lev", transformer_impl=impl,
                            normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                            lev=LEVConfig(seed_dim=8, rank=4, num_knots=5, num_heads=4))
        cfg = build_transformer_config(mc, num_layers=2, hidden_size=64, num_attention_heads=4, fp8=fp8)
        return build_gpt_model(config=cfg, model_config=mc).cuda().eval()

    ids = torch.randint(0, 1024, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(2, 32)
    te_model = build("transformer_engine", fp8="hybrid")
    te_model(ids, pos, None).float().sum()  # an FP8 step fills the FP8 metadata saved as _extra_state
    te_model.config.fp8 = None
    with torch.no_grad():
        te_logits = te_model(ids, pos, None).float()
    dist_checkpointing.save({"model": te_model.sharded_state_dict()}, f"{tmp}/te")
    local = build("local")
    load_model_weights([local], f"{tmp}/te")
    with torch.no_grad():
        te_to_local = (local(ids, pos, None).float() - te_logits).abs().max().item()
    dist_checkpointing.save({"model": local.sharded_state_dict()}, f"{tmp}/local")
    te_again = build("transformer_engine")
    load_model_weights([te_again], f"{tmp}/local")
    with torch.no_grad():
        local_to_te = (te_again(ids, pos, None).float() - te_logits).abs().max().item()
    return {"te_to_local": te_to_local, "local_to_te": local_to_te}
