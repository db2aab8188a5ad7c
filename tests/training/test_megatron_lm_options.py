"""Megatron-LM options that reach megatron-core through the training loop's own builders:

- ``--no-mmap-bin-files``: the run's datasets read the ``.bin`` files with file reads, not a memory map;
- ``--use-precision-aware-optimizer`` with ``--main-grads-dtype``/``--main-params-dtype``/
  ``--exp-avg-dtype``/``--exp-avg-sq-dtype``: the OptimizerConfig the loop builds carries them as
  Megatron-LM's does; without Transformer Engine, or without the distributed optimizer, it is refused in
  one line naming what is needed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lev.arguments import parse_args
from megatron_lev.config import RunConfig
from megatron_lev.lev.config import ConfigError

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"]
MOCK = ["--mock-data", "--vocab-size", "1000"]


# ------------------------------------------------------------------------------------------ data


@pytest.fixture
def dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        builder.add_document(torch.from_numpy(rng.integers(1, 999, size=20).astype(np.int64)), [20])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("flags, mmap", [([], True), (["--no-mmap-bin-files"], False)])
def test_no_mmap_bin_files_reaches_the_indexed_dataset(dataset, flags, mmap):
    from megatron.core.datasets.indexed_dataset import _FileBinReader, _MMapBinReader

    from megatron_lev.training.data import build_datasets
    from megatron_lev.training.loop import _setup_configs

    argv = MODEL + ["--eval-iters", "0", "--split", "1,0,0", "--data-path", dataset,
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"] + flags
    rc, tok, _, _ = _setup_configs(argv)
    train, _, _ = build_datasets(rc, tok)
    assert train.config.mmap_bin_files is mmap
    indexed = train.dataset
    assert indexed.mmap is mmap
    assert isinstance(indexed.bin_reader, _MMapBinReader if mmap else _FileBinReader)
    assert len(train[0]["tokens"]) == 8  # the file reader reads the same samples


# ------------------------------------------------------------------------------------------ optimizer

PRECISION_AWARE = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer"]
DTYPES = ["--main-grads-dtype", "bf16", "--main-params-dtype", "fp16", "--exp-avg-dtype", "fp8",
          "--exp-avg-sq-dtype", "bf16"]


def _parse(extra):
    return parse_args(MODEL + MOCK + extra, world_size=1)


@pytest.mark.parametrize("extra, message", [
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer needs --use-distributed-optimizer"),
    (["--use-precision-aware-optimizer", "--use-distributed-optimizer", "--optimizer", "sgd"],
     "--use-precision-aware-optimizer needs --optimizer adam (got sgd)"),
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--bf16", "--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
])
def test_precision_aware_optimizer_refusals_name_what_is_needed(extra, message):
    with pytest.raises(ConfigError) as e:
        _parse(extra)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_precision_aware_optimizer_without_transformer_engine_is_refused_in_one_line():
    from megatron_lev.arguments.precision import precision_aware_optimizer_refusal

    if precision_aware_optimizer_refusal() is None:  # Transformer Engine's FusedAdam is megatron-core's Adam
        assert _parse(PRECISION_AWARE).use_precision_aware_optimizer
        return
    with pytest.raises(ConfigError) as e:
        _parse(PRECISION_AWARE)
    msg = str(e.value)
    assert msg.startswith("--use-precision-aware-optimizer needs Transformer Engine's FusedAdam") and "\n" not in msg
    assert "install transformer-engine[pytorch]" in msg


def test_default_optimizer_config_keeps_every_state_in_fp32():
    from megatron_lev.training.loop import optimizer_config

    args = _parse(["--bf16", "--use-distributed-optimizer"])
    cfg = optimizer_config(RunConfig.from_args(args), torch.bfloat16)
    assert not cfg.use_precision_aware_optimizer and cfg.use_distributed_optimizer and cfg.bf16
    assert {cfg.main_grads_dtype, cfg.main_params_dtype, cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype} == {torch.float32}
    assert cfg.fp8_recipe is None  # no FP8
    fp8 = _parse(["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    assert optimizer_config(RunConfig.from_args(fp8), torch.bfloat16).fp8_recipe == "tensorwise"
    assert args.accumulate_allreduce_grads_in_fp32  # bf16: fp32 gradient buffers, as Megatron-LM


@pytest.fixture
def te_fused_adam(monkeypatch):
    """A stand-in for Transformer Engine's FusedAdam with the signature megatron-core's OptimizerConfig
    inspects, installed where megatron-core looks for it (``transformer_engine.pytorch.optimizers`` and
    ``megatron.core.optimizer.Adam``), so that the OptimizerConfig the loop builds can be checked on a
    machine without TE. It is never stepped."""
    import sys
    import types

    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.utils as mcore_utils

    from megatron_lev.models.config import te_available

    te_available()  # megatron-core's own TE probes run first, against the real installation

    class FusedAdam:
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True,
                     master_weights=False, master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                     exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False, store_param_remainders=False):
            raise AssertionError("the stand-in FusedAdam is for configuration checks only")

    FusedAdam.__module__ = "transformer_engine.pytorch.optimizers"
    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.8.0"
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    te.pytorch.optimizers.FusedAdam = FusedAdam
    for name, module in (("transformer_engine", te), ("transformer_engine.pytorch", te.pytorch),
                         ("transformer_engine.pytorch.optimizers", te.pytorch.optimizers)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(mcore_optimizer, "Adam", FusedAdam)
    monkeypatch.setattr(mcore_utils, "_te_version", None)  # megatron-core caches the TE version it reads
    return FusedAdam


def test_precision_aware_optimizer_config_carries_the_state_dtypes(te_fused_adam):
    from megatron_lev.training.loop import optimizer_config

    args = _parse(PRECISION_AWARE + DTYPES)
    cfg = optimizer_config(RunConfig.from_args(args), torch.bfloat16)
    assert cfg.use_precision_aware_optimizer and cfg.use_distributed_optimizer
    assert (cfg.main_grads_dtype, cfg.main_params_dtype, cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype) == \
        (torch.bfloat16, torch.float16, torch.uint8, torch.bfloat16)
    # megatron-core: with main parameters other than fp32, TE's FusedAdam keeps them (decoupled grads).
    assert cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    # bf16 main gradients: the gradient buffers, and their reduction, are bf16 (Megatron-LM's rule).
    assert not args.accumulate_allreduce_grads_in_fp32
    # The defaults: fp32 states, fp32 gradient buffers.
    args = _parse(PRECISION_AWARE)
    cfg = optimizer_config(RunConfig.from_args(args), torch.bfloat16)
    assert cfg.use_precision_aware_optimizer and cfg.main_grads_dtype == cfg.exp_avg_dtype == torch.float32
    assert args.accumulate_allreduce_grads_in_fp32


def test_bf16_main_grads_need_bf16(te_fused_adam):
    with pytest.raises(ConfigError, match="^--main-grads-dtype bf16 needs --bf16$"):
        _parse(["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"])


LEV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "1000",
       "--eval-iters", "1", "--quiet-config", "--input-embedding", "lev", "--lev-seed-dim", "16", "--lev-rank", "8",
       "--lev-heads", "2", "--lev-knots", "8"] + MOCK + PRECISION_AWARE + \
      ["--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def precision_aware_state(argv):
    """The Adam megatron-core builds for ``argv`` (a "call" step of the multi-run job): its class, the
    state dtypes it was given, and the dtypes of the gradient buffers."""
    from megatron_lev.models import factory
    from megatron_lev.training import loop

    rc, _tok, config, model_config = loop._setup_configs(argv)
    chunks = factory.build_model_chunks(config, model_config)
    model = loop._wrap_model(rc, config, chunks)
    optimizer, _ = loop._build_optimizer(rc, config, model)
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])][0]
    return {"adam": f"{type(inner).__module__}.{type(inner).__name__}",
            "exp_avg_dtype": str(getattr(inner, "exp_avg_dtype", None)),
            "exp_avg_sq_dtype": str(getattr(inner, "exp_avg_sq_dtype", None)),
            "grad_dtypes": sorted({str(b.grad_dtype) for c in model for b in c.buffers})}


@pytest.mark.gpu
@pytest.mark.te
def test_precision_aware_optimizer_trains_with_transformer_engine(tmp_path):
    import json

    from tests.training._multi_run import launch_plan

    metrics = tmp_path / "m.jsonl"
    plan = [{"name": "train", "argv": LEV + ["--train-iters", "3", "--metrics-file", str(metrics)]},
            {"name": "state", "call": "tests.training.test_megatron_lm_options:precision_aware_state",
             "args": [LEV + ["--train-iters", "3"]]}]
    runs = launch_plan(1, plan, tmp_path / "job")
    for name in ("train", "state"):
        assert runs[name].code == 0, f"{name}:\n{runs[name].stdout[-3000:]}\n{runs[name].job_stderr[-5000:]}"
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    losses = [r["lm loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    state = runs["state"].results[0]
    assert state["adam"].startswith("transformer_engine.") and "FusedAdam" in state["adam"], state
    assert state["exp_avg_dtype"] == state["exp_avg_sq_dtype"] == "torch.bfloat16", state
    assert state["grad_dtypes"] == ["torch.bfloat16"], state  # --main-grads-dtype bf16: bf16 gradient buffers


# ------------------------------------------------------------------------------------------ checkpoint loading


@pytest.fixture(scope="module")
def one_rank():
    from megatron_lev.distributed import destroy_distributed, init_distributed

    setup = init_distributed(tp=1, pp=1, backend="gloo", timeout_minutes=1, seed=1)
    yield
    destroy_distributed(setup)


@pytest.fixture(scope="module")
def saved_checkpoint(one_rank, tmp_path_factory):
    """A one-process checkpoint of a tiny model (weights and RNG state; no optimizer), and the run's parts."""
    from megatron_lev import checkpoint
    from megatron_lev.arguments import resolved_config
    from megatron_lev.models import factory
    from megatron_lev.training.loop import _setup_configs

    root = str(tmp_path_factory.mktemp("strictness"))
    rc, _, config, model_config = _setup_configs(MODEL + MOCK + ["--quiet-config"])
    model = factory.build_model_chunks(config, model_config)
    checkpoint.save_checkpoint(root, 1, model, None, None, consumed_train_samples=1, counters={},
                               config=resolved_config(rc.to_saved_args()), save_optim=False, save_rng=True, log=lambda *_: None)
    return root, model


@pytest.mark.parametrize("strictness", ["assume_ok_unexpected", "log_all", "raise_all", "raise_unexpected"])
def test_dist_ckpt_strictness_reaches_the_load(saved_checkpoint, strictness):
    """Loaded without its RNG state (--no-load-rng), the checkpoint holds a key the load does not ask for:
    a raising --dist-ckpt-strictness refuses it in one line, the others load."""
    from megatron_lev import checkpoint
    from megatron_lev.training.loop import _setup_configs

    root, model = saved_checkpoint
    rc = _setup_configs(MODEL + MOCK + ["--dist-ckpt-strictness", strictness])[0]
    load = lambda: checkpoint.load_checkpoint(root, model, None, None, run_args=rc.to_saved_args(),  # noqa: E731
                                              load_optim=False, load_rng=False, log=lambda *_: None)
    if strictness != "raise_all":  # raise_unexpected: a checkpoint key left unread is no unexpected key
        assert load()["iteration"] == 1
        return
    with pytest.raises(checkpoint.CheckpointError) as e:
        load()
    assert str(e.value).startswith("--dist-ckpt-strictness raise_all: ") and "rng_state" in str(e.value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ model options


def _model_grads(flags):
    """The TransformerConfig of MODEL + flags, its first layer, and the gradients of one forward-backward."""
    from megatron_lev.models import factory
    from megatron_lev.distributed import set_seed
    from megatron_lev.training.loop import _setup_configs

    argv = MODEL + MOCK + ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-layers", "2",
                           "--disable-bias-linear"] + flags
    _, _, config, model_config = _setup_configs(argv)
    set_seed(3)
    model = factory.build_model_chunks(config, model_config)[0]
    tokens = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(8).repeat(2, 1), None, labels=torch.roll(tokens, -1, 1)).sum().backward()
    return config, model.decoder.layers[0], {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_modules_reach_the_layers_and_leave_the_gradients_alone(one_rank):
    config, layer, grads = _model_grads(["--recompute-activations", "--recompute-modules", "core_attn", "mlp"])
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn", "mlp"]
    assert layer.recompute_mlp and layer.self_attention.checkpoint_core_attention
    _, plain_layer, plain = _model_grads([])
    assert not plain_layer.recompute_mlp and not plain_layer.self_attention.checkpoint_core_attention
    assert grads.keys() == plain.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("extra, message", [
    (["--recompute-modules", "mlp"], "--recompute-modules mlp needs --recompute-granularity selective"),
    (["--recompute-activations", "--recompute-modules", "mlp"], "--recompute-modules mlp needs --disable-bias-linear"),
    (["--recompute-activations", "--recompute-modules", "mla_up_proj"], "--recompute-modules mla_up_proj: multi-latent"),
    (["--recompute-activations", "--recompute-modules", "moe"], "--recompute-modules moe needs an MoE model"),
    (["--recompute-activations", "--recompute-modules", "layernorm", "--transformer-impl", "local"],
     "--recompute-modules layernorm needs the Transformer Engine layer spec"),
])
def test_recompute_modules_a_model_cannot_honour_are_refused(extra, message):
    with pytest.raises(ConfigError) as e:
        _parse(extra)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_disable_bf16_reduced_precision_matmul_reaches_torch():
    from megatron_lev.models import factory

    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        args = _parse(["--bf16", "--disable-bf16-reduced-precision-matmul"])
        config, _ = factory.build_configs(RunConfig.from_saved_args(vars(args) | {"padded_vocab_size": 1024}))
        assert config.disable_bf16_reduced_precision_matmul
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        factory.build_configs(RunConfig.from_saved_args(vars(_parse(["--bf16"])) | {"padded_vocab_size": 1024}))
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is True  # left alone without it
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize("extra, due", [
    ([], [10, 20]),  # --tensorboard-log-interval defaults to 1, but there is nothing to write the scalars to
    (["--tensorboard-dir", "TB"], list(range(1, 21))),
    (["--tensorboard-dir", "TB", "--tensorboard-log-interval", "4"], [4, 8, 10, 12, 16, 20]),
    (["--wandb-project", "p", "--tensorboard-log-interval", "5"], [5, 10, 15, 20]),
])
def test_params_norm_runs_on_the_logged_iterations_only(extra, due):
    from megatron_lev.training.loop import params_norm_due

    rc = RunConfig.from_args(_parse(["--log-params-norm", "--log-interval", "10"] + extra))
    assert [i for i in range(1, 21) if params_norm_due(rc, i)] == due
    off = RunConfig.from_args(_parse(["--log-interval", "10"] + extra))
    assert not any(params_norm_due(off, i) for i in range(1, 21))


def test_params_norm_is_the_l2_norm_of_every_parameter(one_rank):
    from megatron_lev.models import factory
    from megatron_lev.training.loop import _setup_configs
    from megatron_lev.training.params_norm import params_l2_norm

    _, _, config, model_config = _setup_configs(MODEL + MOCK + ["--untie-embeddings-and-output-weights"])
    model = factory.build_model_chunks(config, model_config)
    expected = torch.sqrt(sum(p.detach().double().square().sum() for p in model[0].parameters()))
    assert params_l2_norm(model) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("extra, due", [
    ([], [10, 20]),
    (["--use-distributed-optimizer"], [10, 20]),  # one data-parallel rank: its shard is every gradient
])
def test_grad_group_norms_run_on_the_logged_iterations_only(extra, due):
    from megatron_lev.training.loop import grad_groups_due

    rc = RunConfig.from_args(_parse(["--log-interval", "10"] + extra))
    assert [i for i in range(1, 21) if grad_groups_due(rc, i)] == due


@pytest.mark.parametrize("arm", ["tied", "lev"])
def test_grad_group_norms_split_the_global_norm_by_input_side_body_and_head(one_rank, arm):
    from megatron_lev.models import factory
    from megatron_lev.training import grad_groups
    from megatron_lev.training.loop import _setup_configs

    lev = ["--lev-seed-dim", "8", "--lev-rank", "4", "--lev-heads", "2", "--lev-knots", "5"] if arm == "lev" else []
    _, _, config, model_config = _setup_configs(MODEL + MOCK + ["--input-embedding", arm] + lev)
    (model,) = factory.build_model_chunks(config, model_config)
    tokens = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).sum().backward()
    squares = grad_groups.group_squares([model]).tolist()
    by_group = {g: 0.0 for g in grad_groups.GROUPS}
    for name, p in model.named_parameters():
        by_group[grad_groups.group_of(name)] += float(p.grad.double().square().sum())
    assert squares == pytest.approx([by_group[g] for g in grad_groups.GROUPS], rel=1e-5)
    assert all(v > 0 for k, v in by_group.items() if k != "head" or arm != "tied")
    assert (by_group["head"] == 0) == (arm == "tied")  # the tied table is the input side's (its head gradient too)
    total = sum(float(p.grad.double().square().sum()) for p in model.parameters()) ** 0.5
    norms = grad_groups.norms(squares)
    assert sum(v * v for v in norms.values()) ** 0.5 == pytest.approx(total, rel=1e-5)


def test_clipping_is_recorded_where_megatrons_coefficient_is_below_one():
    from megatron_lev.training.grad_groups import clipped

    assert clipped(1.5, 1.0) is True and clipped(0.5, 1.0) is False
    assert clipped(1.0, 1.0) is True and clipped(0.999998, 1.0) is False  # megatron scales when 1 / (norm + 1e-6) < 1
    assert clipped(None, 1.0) is None and clipped(2.0, 0.0) is None  # no norm, or clipping off


# ------------------------------------------------------------------------------------------ log writers


def _wandb_without_login(argv):
    """wandb starts on the last rank alone, and fails there (no API key on the node): the run's start-up
    stops on every rank with its line (the other ranks do not go on to wait for it in the model's build)."""
    import sys
    import types

    from megatron_lev.training.loop import _setup_configs, _start, _StartupError

    def init(**_kw):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    sys.modules["wandb"] = types.SimpleNamespace(init=init)
    try:
        rc, _, config, model_config = _setup_configs(argv)
        try:
            _start(rc, config, model_config)
        except _StartupError as e:
            return str(e)
        return None
    finally:
        del sys.modules["wandb"]


def test_a_log_writer_failing_on_rank_0_stops_every_rank_in_one_line():
    from megatron_lev.testing import run_distributed

    r0, r1 = run_distributed(_wandb_without_login, 2, args=(MODEL + MOCK + ["--wandb-project", "p", "--quiet-config"],))
    assert r0 == r1 and r0 is not None, (r0, r1)
    assert r0.startswith("--wandb-project p: wandb cannot start (RuntimeError: api_key not configured (no-tty)"), r0
    assert r0.endswith("log in with `wandb login`, or set WANDB_MODE=offline"), r0


@pytest.mark.parametrize("flag, module, name", [("--tensorboard-dir", "torch.utils.tensorboard", "TensorBoard"),
                                                ("--wandb-project", "wandb", "wandb")])
def test_a_log_writer_that_fails_as_it_imports_is_a_log_writer_error(flag, module, name, tmp_path, monkeypatch):
    """An install that raises something else than ImportError as it imports (a tensorboard whose protobuf
    does not match) is the writer's one line, which the start-up sends from rank 0 to every rank; raised as
    it was, rank 0 died alone with a traceback."""
    import sys

    from megatron_lev.training.logger import LogWriterError, TrainingLogger

    class Broken:  # finds the module by failing as a broken install fails
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname == module:
                raise TypeError("Descriptors cannot be created directly.\nIf this call came from a _pb2.py file ...")
            return None

    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    args = parse_args(MODEL + MOCK + [flag, str(tmp_path / "w"), "--quiet-config"])
    with pytest.raises(LogWriterError) as e:
        TrainingLogger(RunConfig.from_args(args).logging)
    assert str(e.value).startswith(f"{flag} {tmp_path / 'w'}: {name} cannot be imported (TypeError: Descriptors "
                                   "cannot be created directly.); repair its installation or drop the flag")
