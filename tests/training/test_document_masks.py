"""Megatron-LM's document flags take effect through the training loop's own data path (``build_datasets``,
``get_batch``) and the model: with ``--reset-attention-mask`` a token's logits do not change when the
documents before it in the sample change; ``--reset-position-ids`` restarts the learned positions at each
document; ``--eod-mask-loss`` leaves the EOD tokens out of the loss mask; what a layout cannot honour is
refused in one line. One process (world size 1), a two-layer model, a small indexed corpus written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lev.arguments import parse_args
from megatron_lev.lev.config import ConfigError

VOCAB, SEQ = 200, 48
EOD = VOCAB  # the NullTokenizer's EOD is the id after its vocabulary
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--eval-iters", "0", "--split", "1,0,0", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(VOCAB), "--input-embedding", "lev", "--lev-seed-dim", "8", "--lev-rank", "4",
         "--lev-heads", "2", "--lev-knots", "4", "--quiet-config"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of 5 to 14 tokens, each ended by the EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("documents") / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(60):
        doc = np.append(rng.integers(1, VOCAB, size=int(rng.integers(4, 14))), EOD).astype(np.int64)
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def one_rank():
    from megatron_lev.distributed import destroy_distributed, init_distributed

    setup = init_distributed(tp=1, pp=1, backend="gloo", timeout_minutes=1, seed=1234)
    yield
    destroy_distributed(setup)


def _run_parts(corpus, flags):
    """(first training sample as the dataset gives it, the model) for MODEL + flags over ``corpus``."""
    from megatron_lev.models import factory
    from megatron_lev.training.data import build_datasets
    from megatron_lev.training.loop import _setup_configs

    rc, tokenizer, config, model_config = _setup_configs(MODEL + ["--data-path", corpus] + flags)
    train, _, _ = build_datasets(rc, tokenizer)
    model = factory.build_model_chunks(config, model_config)[0].eval()
    return train[0], model


def _logits(model, sample):
    """The model's logits for one sample, through the loop's own batch path (get_batch)."""
    from megatron_lev.training.data import _collate, get_batch

    tokens, _, _, attention_mask, position_ids = get_batch(iter([_collate([sample])]))
    with torch.no_grad():
        return model(tokens, position_ids, attention_mask)[0].float()


def _last_document(sample) -> int:
    """Where the sample's last whole document before its final tokens ends (an EOD with tokens after it)."""
    ends = [i for i, t in enumerate(sample["tokens"].tolist()) if t == EOD and i < SEQ - 3]
    assert len(ends) >= 2, sample["tokens"]
    return ends[-1]


def _earlier_documents_changed(sample, end: int):
    """The sample with every token before ``end`` replaced (the EODs kept: the same document boundaries)."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.as_tensor(sample["tokens"]).clone()
    before = tokens[:end]
    new = torch.randint(1, VOCAB, before.shape, generator=g, dtype=tokens.dtype)
    tokens[:end] = torch.where(before == EOD, before, new)
    assert not torch.equal(tokens, torch.as_tensor(sample["tokens"]))
    return dict(sample, tokens=tokens)


@pytest.mark.parametrize("positions", [["--position-embedding-type", "rope"],
                                       ["--position-embedding-type", "learned_absolute", "--reset-position-ids"]])
def test_with_reset_attention_mask_a_token_does_not_see_the_documents_before_it(corpus, one_rank, positions):
    sample, model = _run_parts(corpus, positions + ["--reset-attention-mask"])
    assert sample["attention_mask"].shape == (1, SEQ, SEQ)  # built by the dataset, True = masked
    end = _last_document(sample)
    logits, changed = _logits(model, sample), _logits(model, _earlier_documents_changed(sample, end))
    torch.testing.assert_close(changed[end + 1:], logits[end + 1:], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:end], logits[:end], atol=1e-3)  # the changed documents' own logits move

    # Without the flag the loader builds no mask (causal in the kernel): the last document sees the others.
    plain, model = _run_parts(corpus, positions[:2])
    assert "attention_mask" not in plain
    logits, changed = _logits(model, plain), _logits(model, _earlier_documents_changed(plain, end))
    assert not torch.allclose(changed[end + 1:], logits[end + 1:], atol=1e-3)


def test_the_loop_builds_the_additive_mask_once_and_every_layer_takes_it_as_it_is(corpus, one_rank, monkeypatch):
    from megatron_lev.models import attention
    from megatron_lev.training.data import _collate, get_batch

    sample, model = _run_parts(corpus, ["--position-embedding-type", "rope", "--reset-attention-mask"])
    tokens, _, _, mask, position_ids = get_batch(iter([_collate([sample])]), mask_dtype=torch.float32)
    assert mask.dtype == torch.float32 and torch.equal(mask == float("-inf"), sample["attention_mask"][None])
    assert torch.equal(mask[mask != float("-inf")], torch.zeros(int((mask == 0).sum())))
    seen, sdpa = [], attention.F.scaled_dot_product_attention

    def recorded(*a, attn_mask=None, **kw):
        seen.append(attn_mask)
        return sdpa(*a, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recorded)
    with torch.no_grad():
        logits = model(tokens, position_ids, mask)[0].float()
    assert len(seen) == 2 and all(m is mask for m in seen)  # each layer: the batch's mask, no copy
    seen.clear()
    torch.testing.assert_close(logits, _logits(model, sample), rtol=0, atol=1e-6)  # the boolean mask's result
    assert len(seen) == 2 and all(m.dtype == torch.bool for m in seen)


def test_reset_position_ids_restart_the_learned_positions_at_each_document(corpus, one_rank):
    flags = ["--position-embedding-type", "learned_absolute", "--reset-attention-mask"]
    sample, model = _run_parts(corpus, flags + ["--reset-position-ids"])
    end = _last_document(sample)
    positions = sample["position_ids"].tolist()
    assert positions[end + 1:] == list(range(SEQ - end - 1)) and positions[end] > 0
    # The last document alone at the start of a sample: the same logits (its positions restarted there too).
    alone = dict(sample, tokens=torch.roll(torch.as_tensor(sample["tokens"]), -(end + 1)),
                 position_ids=torch.arange(SEQ), attention_mask=torch.ones(1, SEQ, SEQ).tril() < 0.5)
    n = SEQ - end - 1
    torch.testing.assert_close(_logits(model, alone)[:n], _logits(model, sample)[end + 1:], rtol=0, atol=1e-5)

    sample, model = _run_parts(corpus, flags)  # positions carry on across documents without the flag
    assert sample["position_ids"].tolist() == list(range(SEQ))


def test_eod_mask_loss_leaves_the_eod_tokens_out_of_the_loss(corpus, one_rank):
    sample, _ = _run_parts(corpus, ["--eod-mask-loss"])
    tokens, mask = torch.as_tensor(sample["tokens"]), torch.as_tensor(sample["loss_mask"])
    assert (tokens == EOD).any() and torch.equal(mask, (tokens != EOD).float())
    sample, _ = _run_parts(corpus, [])
    assert torch.equal(torch.as_tensor(sample["loss_mask"]), torch.ones(SEQ))


def _parse(extra):
    return parse_args(MODEL + ["--data-path", "corpus"] + extra, world_size=1)


def test_what_a_layout_cannot_honour_is_refused_in_one_line(monkeypatch):
    with pytest.raises(ConfigError) as e:
        _parse(["--position-embedding-type", "rope", "--reset-position-ids"])
    assert str(e.value).startswith("--reset-position-ids with --position-embedding-type rope: ")
    assert _parse(["--position-embedding-type", "rope", "--reset-position-ids", "--reset-attention-mask"])

    from megatron_lev.models import config as model_config

    monkeypatch.setattr(model_config, "use_transformer_engine", lambda impl="auto": True)
    with pytest.raises(ConfigError) as e:
        _parse(["--reset-attention-mask"])
    assert str(e.value).startswith("--reset-attention-mask: the Transformer Engine layer spec") and \
        "\n" not in str(e.value)
