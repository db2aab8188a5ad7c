"""Rank-side helpers of the conversion tests (module level: run_distributed spawns fresh processes).

``checkpoint_logits`` builds each checkpoint's model at the layout of the launch, loads it and
returns the full-vocabulary logits for the given ids: the first pipeline stage sends its hidden
states to the second by point-to-point messages, the last stage's vocab-parallel logits are
gathered over TP.
"""

from __future__ import annotations

import torch


def _forward(chunks, ids: torch.Tensor):
    from megatron.core import parallel_state as ps

    model = chunks[0]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    pp = ps.get_pipeline_model_parallel_world_size()
    with torch.no_grad():
        if pp == 1:
            out = model(ids, pos, None)
        elif ps.is_pipeline_first_stage(ignore_virtual=True):
            hidden = model(ids, pos, None)
            torch.distributed.send(hidden.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
        else:
            b, s = ids.shape
            hidden = torch.empty(s, b, model.config.hidden_size)
            torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
            out = model(ids, pos, None)
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            parts = [torch.empty_like(out) for _ in range(tp)]
            torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
            out = torch.cat(parts, dim=-1)
    return out.float()


def checkpoint_logits(checkpoints, ids):
    """{path: logits [b, s, V]} on the rank that holds them (TP rank 0 of the last stage), else {}."""
    from megatron.core import parallel_state as ps

    from megatron_lev.conversion.model_io import build_model, layout_args, load_model_weights
    from megatron_lev.conversion.source import open_checkpoint

    ids = torch.as_tensor(ids).long()
    out = {}
    for path in checkpoints:
        src = open_checkpoint(path)
        a = layout_args(src.config(), ps.get_tensor_model_parallel_world_size(),
                        ps.get_pipeline_model_parallel_world_size())
        chunks, _c, _m = build_model(a)
        load_model_weights(chunks, src.path)
        logits = _forward(chunks, ids)
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
            out[path] = logits
    return out


def logits_at_layouts(plan, ids, by_layout=False):
    """``checkpoint_logits`` for each ``(tp, pp, [paths])`` of ``plan`` in turn, re-creating megatron's
    parallel groups between layouts (a launch costs seconds of imports; a re-initialisation does not).
    Ranks outside data-parallel rank 0 compute but return nothing. ``by_layout``: key the results by
    ``(tp, pp, path)`` (one checkpoint read at several layouts)."""
    from megatron.core import parallel_state as ps

    out = {}
    for i, (tp, pp, paths) in enumerate(plan):
        if i:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        assert ps.get_tensor_model_parallel_world_size() == tp and ps.get_pipeline_model_parallel_world_size() == pp
        res = checkpoint_logits(paths, ids)
        if ps.get_data_parallel_rank() == 0:
            out.update({((tp, pp, k) if by_layout else k): v for k, v in res.items()})
    return out



def convert_sources(root: str, arms) -> None:
    """Each arm's source checkpoint resharded to TP=1 (``<arm>_tp1``), and the tied one back to
    TP=2 x PP=2 (``tied_back``)."""
    from pathlib import Path

    from megatron_lev.conversion import reshard_checkpoint

    root = Path(root)
    for arm in arms:
        reshard_checkpoint(root / f"{arm}_src", root / f"{arm}_tp1", tp=1, pp=1, progress=False)
    reshard_checkpoint(root / "tied_tp1", root / "tied_back", tp=2, pp=2, progress=False)


def model_args(argv):
    """The resolved arguments (``config.yaml``'s) of pretrain_lev.py flags ``argv`` at TP=1, the padded
    vocabulary set as training sets it."""
    from megatron_lev.arguments import parse_args, resolved_config
    from megatron_lev.tokenizer import padded_vocab_size
    from megatron_lev.tokenizer.spec import TokenizerSpec

    args = parse_args(list(map(str, argv)), world_size=1)
    a = resolved_config(args)
    spec = TokenizerSpec.from_args(args)
    vocab = spec.build().vocab_size if spec is not None else int(args.vocab_size) + 1
    a["padded_vocab_size"] = padded_vocab_size(vocab, a["make_vocab_size_divisible_by"], 1)
    return a


def save_random_models(plan):
    """For each ``(save_dir, resolved arguments)`` of ``plan``: the model built at TP=1 with every parameter
    drawn at random (norm scales and biases too, so that a misplaced one changes the logits), saved as
    iteration 1 with the training checkpointer. A launch's imports are shared by all of them."""
    from megatron_lev.config.saved import SavedConfig
    from megatron_lev.conversion.model_io import build_model, save_model_checkpoint
    from megatron_lev.distributed import set_seed

    for k, (save, a) in enumerate(plan):
        set_seed(1234 + k)
        chunks, _config, _mc = build_model(SavedConfig.read(a), fast_init=False)
        with torch.no_grad():
            for name, p in chunks[0].named_parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.08)
                else:  # biases and norm scales (megatron stores a zero-centred scale minus 1)
                    one = name.endswith("norm.weight") or name.endswith("layer_norm_weight")
                    p.normal_(0, 0.2).add_(1.0 if one and not a.get("layernorm_zero_centered_gamma") else 0.0)
        save_model_checkpoint(chunks, save, 1, SavedConfig.read(a), {})
