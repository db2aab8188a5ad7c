"""``RunConfig.model`` holds every model flag, and reads a saved ``config.yaml`` that lacks some of them
with each flag's default (what a run without the flag used). Parsing only: no model, no process group."""

from __future__ import annotations

import argparse
import dataclasses

from megatron_lev.arguments import parse_args, resolved_config
from megatron_lev.arguments.lev import add_lev_flags
from megatron_lev.arguments.model import add_model_flags
from megatron_lev.arguments.moe import add_moe_flags
from megatron_lev.config import ModelRunConfig, RunConfig, flat_names
from megatron_lev.arguments.validate import FOLDED_INTO
from megatron_lev.lev.config import LEVConfig, lev_arg

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 8 --lr 1e-3 --mock-data --vocab-size 100").split()


def _model_parser():
    p = argparse.ArgumentParser(add_help=False)
    add_model_flags(p)
    add_lev_flags(p)
    add_moe_flags(p)
    return p


def _model_dests():
    return {a.dest for a in _model_parser()._actions if a.dest != argparse.SUPPRESS}


def test_every_model_flag_has_a_field_of_the_model_group():
    names = {f.name for f in dataclasses.fields(ModelRunConfig)} | set(LEVConfig().to_args())  # LEV's nested
    dests = _model_dests() - set(FOLDED_INTO)  # the folded flags have their own group
    assert {"num_layers", "lev_heads", "moe_router_topk", "attention_backend", "bias_swiglu_fusion"} <= dests
    missing = sorted(dests - names - {"seq_length", "expert_model_parallel_size", "expert_tensor_parallel_size"})
    assert not missing, f"model flags without a ModelRunConfig field: {missing}"


def test_each_saved_name_is_one_field():
    names = flat_names()
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_a_saved_file_without_the_model_flags_reads_their_defaults():
    """A key a file lacks reads as the flag's default (the field's)."""
    args = parse_args(BASE + ["--input-embedding", "lev", "--swiglu", "--lev-heads", "4"], world_size=1)
    args.padded_vocab_size = 128
    saved = resolved_config(args)
    kept = {"num_layers", "hidden_size", "num_attention_heads", "input_embedding", "padded_vocab_size", "swiglu",
            "lev_heads", "ffn_hidden_size", "max_position_embeddings", "untie_embeddings_and_output_weights",
            "seq_length"}  # seq_length: a data setting, required
    for name in _model_dests() - kept:
        saved.pop(name, None)
    model, flags = RunConfig.from_saved_args(saved).model, _model_parser()
    lev = {lev_arg(f.name): f.name for f in dataclasses.fields(LEVConfig)}
    for name in _model_dests() - kept - set(FOLDED_INTO) - {"seq_length", "expert_model_parallel_size",
                                                            "expert_tensor_parallel_size"}:
        value = getattr(model.lev, lev[name]) if name in lev else getattr(model, name)
        assert value == flags.get_default(name), name
    assert (model.input_embedding, model.swiglu, model.lev.num_heads) == ("lev", True, 4)
    assert model == RunConfig.from_args(args).model  # this command line gave every other flag its default
