"""Megatron-LM's own launch scripts through ``pretrain_lev.py``: the entry point swapped, ``--input-embedding
lev`` added, the sizes scaled down, and nothing else changed but the flags listed below with their reasons.

The scripts' argv is test data (``data/megatron_lm_examples.json``: the words bash passes to
``pretrain_gpt.py``, taken from NVIDIA/Megatron-LM at the commit named there). One 2-rank job, run as
torchrun runs it (TP=2, gloo), trains both for 3 iterations; the checks read the per-iteration metrics and the resolved
``config.yaml`` saved with the checkpoint, so each of the scripts' flags is seen to have taken effect.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from megatron_lev.arguments import parse_args
from megatron_lev.lev.config import ConfigError
from megatron_lev.testing import train_records
from tests.training._multi_run import launch_plan

# Its tests share multi-process jobs (~42 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

EXAMPLES = json.loads((Path(__file__).parent / "data" / "megatron_lm_examples.json").read_text())
GPT3 = "examples/gpt3/train_gpt3_175b_distributed.sh"
LLAMA = "examples/llama/train_llama3_8b_h100_fp8.sh"


def _has_step_schedule() -> bool:
    from megatron.core import num_microbatches_calculator as nmc

    return hasattr(nmc, "StepBatchsizeNumMicroBatchesCalculator")


STEP_SCHEDULE = _has_step_schedule()

# Sizes only: the scripts' values scaled down (2 CPU ranks, TP=2, 3 iterations, checkpoint and eval at 3).
SCALED: Dict[str, Dict[str, List[str]]] = {
    GPT3: {
        "--num-layers": ["2"], "--hidden-size": ["64"], "--num-attention-heads": ["4"], "--seq-length": ["32"],
        "--max-position-embeddings": ["32"], "--global-batch-size": ["4"],
        # 16 samples from 0 tokens on, growing with the tokens seen: here 2, then 4 from 64 tokens (2 x 32) on.
        "--step-batch-size-schedule": ["0:2 64:4"],
        "--train-iters": ["3"], "--lr-decay-iters": ["3"],
        "--tensor-model-parallel-size": ["2"], "--pipeline-model-parallel-size": ["1"],
        "--log-interval": ["1"], "--save-interval": ["3"], "--eval-interval": ["3"], "--eval-iters": ["1"],
    },
    LLAMA: {
        "--num-layers": ["2"], "--hidden-size": ["64"], "--ffn-hidden-size": ["224"], "--num-attention-heads": ["4"],
        "--num-query-groups": ["2"], "--kv-channels": ["16"], "--seq-length": ["32"],
        "--max-position-embeddings": ["32"], "--global-batch-size": ["4"],
        "--train-samples": ["12"], "--lr-decay-samples": ["12"], "--lr-warmup-samples": ["4"],
        "--tensor-model-parallel-size": ["2"],
        "--log-interval": ["1"], "--eval-iters": ["1"], "--eval-interval": ["3"], "--save-interval": ["3"],
    },
}

# The flags left out, each with its reason (nothing else of the scripts is changed).
DROPPED: Dict[str, Dict[str, str]] = {
    GPT3: {
        "--data-path": "mock data instead of a preprocessed corpus (--mock-data added)",
        # Megatron-LM refuses the pair too ("Cannot specify both --step-batch-size-schedule and
        # --global-batch-size"): the script as shipped does not start there either.
        **({"--global-batch-size": "given with --step-batch-size-schedule, which Megatron-LM refuses as well"}
           if STEP_SCHEDULE else
           {"--step-batch-size-schedule": "the installed megatron-core (< 0.18) has no step-schedule calculator; "
                                          "refused in one line (test_step_schedule_needs_megatron_core_0_18)"}),
    },
    LLAMA: {
        "--fp8-format": "FP8 needs Transformer Engine on CUDA",
        "--fp8-amax-history-len": "FP8 needs Transformer Engine on CUDA",
        "--fp8-amax-compute-algo": "FP8 needs Transformer Engine on CUDA",
        "--fp8-param-gather": "FP8 needs Transformer Engine on CUDA",
        "--attention-backend": "fused attention is Transformer Engine's kernel (CUDA)",
        "--profile": "without --use-pytorch-profiler it records nsys ranges (torch.cuda.profiler): CUDA only",
        "--profile-step-start": "belongs to --profile (dropped)",
        "--profile-step-end": "belongs to --profile (dropped)",
    },
}

# The flags added, with the reason. --input-embedding lev is the change under test.
ADDED: Dict[str, List[List[str]]] = {
    GPT3: [["--mock-data"],  # for --data-path (dropped)
           # The script names no tokenizer type (Megatron-LM needs one too); its vocab/merge files are GPT-2's.
           ["--tokenizer-type", "GPT2BPETokenizer"]],
    # Megatron-LM's logging flags its other scripts pass, seen to take effect below.
    LLAMA: [["--log-params-norm"], ["--log-num-zeros-in-grad"], ["--log-timers-to-tensorboard"],
            ["--log-validation-ppl-to-tensorboard"], ["--log-memory-to-tensorboard"],
            ["--log-world-size-to-tensorboard"], ["--no-log-loss-scale-to-tensorboard"],
            ["--tensorboard-queue-size", "5"]],
}
SCHEDULE_WORDS = "the unquoted ${TRAINING_ARGS[@]} splits the schedule into words; it is one argument"


def scaled_argv(script: str, paths: Dict[str, str], metrics: str) -> List[str]:
    """The script's argv with the sizes scaled, the listed flags dropped and added, the placeholders
    filled from ``paths`` and ``--input-embedding lev``; ``--metrics-file`` records each iteration."""
    argv: List[str] = []
    for line in EXAMPLES["scripts"][script]:
        flag, *words = line.split()
        if flag in DROPPED[script]:
            continue
        if flag == "--step-batch-size-schedule":
            words = [" ".join(words)]  # SCHEDULE_WORDS
        words = SCALED[script].get(flag, words)
        for name, value in paths.items():
            words = [w.replace("$" + name, value) for w in words]
        argv += [flag, *words]
    for extra in ADDED[script]:
        argv += extra
    return argv + ["--input-embedding", "lev", "--metrics-file", metrics]


def real_data_tokenizer(argv: List[str], tokenizer_json: str) -> List[str]:
    """The Llama-3 script's real-data branch's tokenizer flags in ``argv`` (``--tokenizer-type
    HuggingFaceTokenizer --tokenizer-model TOKENIZER --vocab-size 128256``, no tiktoken pattern); the mock
    data stays (a corpus would need preprocessing with that tokenizer, which the tokenizer flags do not change)."""
    out = [w for i, w in enumerate(argv) if w != "--tiktoken-pattern" and (i == 0 or argv[i - 1] != "--tiktoken-pattern")]
    i = out.index("--tokenizer-type")
    return out[:i] + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_json] + out[i + 2:]


def _paths(tmp: Path, name: str, tokenizer_files=None) -> Dict[str, str]:
    paths = {"CHECKPOINT_PATH": str(tmp / name / "ckpt"), "TENSORBOARD_LOGS_PATH": str(tmp / name / "tb"),
             "PWD": str(tmp / name)}
    if tokenizer_files is not None:
        paths.update(VOCAB_FILE=tokenizer_files.vocab_file, MERGE_FILE=tokenizer_files.merge_file)
    return paths


def test_only_the_listed_flags_change():
    """Every flag of each script is kept, scaled, or dropped with a reason; no placeholder is left."""
    for script in (GPT3, LLAMA):
        flags = [line.split()[0] for line in EXAMPLES["scripts"][script]]
        assert set(SCALED[script]) <= set(flags) and set(DROPPED[script]) <= set(flags), script
        argv = scaled_argv(script, _paths(Path("/x"), "s", _FakeTokenizerFiles), "m.jsonl")
        assert not [w for w in argv if "$" in w], argv
        kept = [f for f in flags if f not in DROPPED[script]]
        assert [w for w in argv if w.startswith("--")][:len(kept)] == kept


class _FakeTokenizerFiles:
    vocab_file, merge_file = "vocab.json", "merges.txt"


def test_step_schedule_needs_megatron_core_0_18(tokenizer_files, tmp_path):
    """The GPT-3 script's batch schedule: trained where megatron-core has the step-schedule calculator,
    else refused in one line naming the flag and what to use."""
    argv = scaled_argv(GPT3, _paths(tmp_path, "gpt3", tokenizer_files), str(tmp_path / "m.jsonl"))
    if STEP_SCHEDULE:
        assert "--step-batch-size-schedule" in argv and "--global-batch-size" not in argv
        args = parse_args(argv, world_size=2)
        assert args.global_batch_size == 4
        return
    with pytest.raises(ConfigError) as e:
        parse_args(argv + ["--step-batch-size-schedule", "0:2 64:4"], world_size=2)
    msg = str(e.value)
    assert msg.startswith("--step-batch-size-schedule needs megatron-core >= 0.18") and "\n" not in msg


@pytest.fixture(scope="module")
def runs(tokenizer_files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_lm_scripts")
    plan = []
    for name, script, tok in (("gpt3", GPT3, tokenizer_files), ("llama", LLAMA, None)):
        plan.append({"name": name, "argv": scaled_argv(script, _paths(tmp, name, tok), str(tmp / f"{name}.jsonl"))})
    plan.append({"name": "llama-hf", "argv": real_data_tokenizer(
        scaled_argv(LLAMA, _paths(tmp, "llama-hf"), str(tmp / "llama-hf.jsonl")), tokenizer_files.tokenizer_json)})
    res = launch_plan(2, plan, tmp)
    assert {n: r.code for n, r in res.items()} == {"gpt3": 0, "llama": 0, "llama-hf": 0}, \
        {n: r.stdout[-3000:] for n, r in res.items()}
    return tmp, {n: r.stdout for n, r in res.items()}


def _config(tmp: Path, name: str) -> dict:
    return yaml.safe_load((tmp / name / "ckpt" / "iter_0000003" / "config.yaml").read_text())


@pytest.mark.parametrize("name", ["gpt3", "llama"])
def test_script_trains_three_iterations_with_finite_losses(runs, name):
    tmp, _ = runs
    rows = train_records(tmp / f"{name}.jsonl")
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert math.isfinite(r["lm loss"]) and not r["nan"], r
    valid = [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "valid"]
    assert [v["iteration"] for v in valid] == [3] and math.isfinite(valid[0]["lm loss"])  # --eval-interval 3
    assert (tmp / name / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"  # --save-interval


def test_gpt3_script_flags_took_effect(runs):
    tmp, stdout = runs
    cfg, rows = _config(tmp, "gpt3"), train_records(tmp / "gpt3.jsonl")
    expect = {"input_embedding": "lev", "fp16": True, "tensor_model_parallel_size": 2, "lr_decay_style": "cosine",
              "lr": 6.0e-5, "min_lr": 6.0e-6, "lr_warmup_fraction": 0.001, "lr_decay_iters": 3,
              "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "init_method_std": 0.006,
              "clip_grad": 1.0, "attention_backend": "auto", "split": "949,50,1", "train_iters": 3,
              "tokenizer_type": "GPT2BPETokenizer"}
    assert {k: cfg[k] for k in expect} == expect
    assert list((tmp / "gpt3" / "tb").iterdir())  # --tensorboard-dir
    if STEP_SCHEDULE:
        assert cfg["step_batch_size_schedule"] == "0:2 64:4"
        assert [rows[i]["global_batch_size"] for i in (1, 2, 3)] == [2, 4, 4]
    else:
        assert [rows[i]["global_batch_size"] for i in (1, 2, 3)] == [4, 4, 4]
    # --fp16: megatron-core's dynamic loss scale starts at 2**32 and, as in Megatron-LM, the first steps
    # overflow and are skipped (hysteresis 2: the scale halves from the second on); the LR schedule waits.
    scales = [float(m) for m in re.findall(r"loss scale: ([0-9.]+) \|", stdout["gpt3"])]
    assert scales == [2.0 ** 32, 2.0 ** 31, 2.0 ** 30]
    assert all(rows[i]["skipped"] and rows[i]["grad norm"] is None for i in (1, 2, 3))
    assert [rows[i]["lr"] for i in (1, 2, 3)] == [pytest.approx(6.0e-5)] * 3


def test_llama_script_flags_took_effect(runs):
    tmp, stdout = runs
    cfg, rows = _config(tmp, "llama"), train_records(tmp / "llama.jsonl")
    # --apply-layernorm-1p is megatron-core's layernorm_zero_centered_gamma, as in Megatron-LM.
    expect = {"input_embedding": "lev", "layernorm_zero_centered_gamma": True, "normalization": "RMSNorm", "swiglu": True,
              "num_query_groups": 2, "group_query_attention": True, "kv_channels": 16, "ffn_hidden_size": 224,
              "position_embedding_type": "rope", "rotary_base": 1000000, "rotary_percent": 1.0,
              "untie_embeddings_and_output_weights": True, "disable_bias_linear": True,
              "train_samples": 12, "train_iters": 3, "lr_decay_samples": 12, "lr_warmup_samples": 4,
              "lr_decay_style": "cosine", "decoupled_lr": 5.0e-4, "decoupled_min_lr": 4.5e-5,
              "bf16": True, "grad_reduce_in_bf16": True, "cross_entropy_loss_fusion": True,
              "calculate_per_token_loss": True, "manual_gc": True, "empty_unused_memory_level": 1,
              "exit_duration_in_mins": 235, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
              "overlap_param_gather": True, "sequence_parallel": True, "context_parallel_size": 1,
              "tokenizer_type": "NullTokenizer", "vocab_size": 128256, "tiktoken_pattern": "v2",
              "mmap_bin_files": False, "num_workers": 1, "ckpt_format": "torch_dist",
              "distributed_timeout_minutes": 60}
    assert {k: cfg[k] for k in expect} == expect
    assert list((tmp / "llama" / "benchmark_cache_llama3_8b_fp8").iterdir())  # --data-cache-path
    assert [rows[i]["consumed_samples"] for i in (1, 2, 3)] == [4, 8, 12]
    # Counted in samples: warmup to --lr over 4, cosine decay to --min-lr at 12 (half way at 8).
    assert [rows[i]["lr"] for i in (1, 2, 3)] == [pytest.approx(1.5e-4), pytest.approx(8e-5), pytest.approx(1e-5)]
    assert all(not rows[i]["skipped"] and math.isfinite(rows[i]["grad norm"]) for i in (1, 2, 3))
    # The logging flags: params norm and zero gradients on each (--log-interval 1) line and to TensorBoard,
    # the iteration time, validation perplexity, memory and world size there; no loss scale.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp / "llama" / "tb")).Reload()
    for name, key in (("params-norm", "params norm"), ("num-zeros", "num zeros")):
        assert [e.step for e in tb.Scalars(name)] == [1, 2, 3]
        assert [e.value for e in tb.Scalars(name)] == [pytest.approx(rows[i][key], rel=1e-6) for i in (1, 2, 3)]
    assert all(rows[i]["params norm"] > 0 and rows[i]["num zeros"] >= 0 for i in (1, 2, 3))
    assert rows[1]["params norm"] != rows[3]["params norm"]  # the updated weights (gathered before they are read)
    assert [e.value for e in tb.Scalars("world-size")] == [2, 2, 2]
    assert {"iteration-time", "mem-max-rss-bytes", "validation/lm loss ppl"} <= set(tb.Tags()["scalars"])
    assert "loss-scale" not in tb.Tags()["scalars"]
    assert stdout["llama"].count(" | num zeros: ") == stdout["llama"].count(" | params norm: ") == 3


def test_llama_scripts_real_data_tokenizer_flags_start_with_vocab_size_as_the_models_vocabulary(runs):
    """The script's real-data branch gives --vocab-size 128256 beside its tokenizer.json: the model's
    vocabulary (one line says so), as Megatron-LM takes it; before, refused as a NullTokenizer-only flag."""
    tmp, stdout = runs
    cfg, rows = _config(tmp, "llama-hf"), train_records(tmp / "llama-hf.jsonl")
    assert (cfg["tokenizer_type"], cfg["vocab_size"], cfg["padded_vocab_size"]) == ("HuggingFaceTokenizer", 128256,
                                                                                    128256)
    assert sorted(rows) == [1, 2, 3] and all(math.isfinite(r["lm loss"]) for r in rows.values())
    notice = re.search(r" > --vocab-size 128256 beside the HuggingFaceTokenizer \((\d+) ids\): the model's vocabulary "
                       r"is 128256, 128256 rows once padded", stdout["llama-hf"])
    assert notice and int(notice.group(1)) < 128256, stdout["llama-hf"][-3000:]
