"""Arguments: Megatron-LM flag names, YAML config overridden by the command line, one-line errors,
and the resolved config's round trip through YAML. In-process (no ranks) except the CLI checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from megatron_lev.arguments import config_to_yaml, parse_args, resolved_config
from megatron_lev.lev.config import ConfigError
from megatron_lev.testing.cli import run_cli
from tests.conftest import tokenizer_flags

REPO = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--vocab-size", "255"]


def test_defaults_follow_megatron_and_derive_microbatches():
    a = parse_args(BASE + ["--global-batch-size", "16"], world_size=4)
    assert a.data_parallel_size == 4 and a.num_microbatches == 2
    assert a.input_embedding == "tied" and a.ffn_hidden_size == 256
    assert a.max_position_embeddings == 32 and a.lr_decay_iters == 10
    a = parse_args(BASE + ["--untie-embeddings-and-output-weights", "--swiglu"], world_size=1)
    assert a.input_embedding == "untied" and a.global_batch_size == 2 and a.ffn_hidden_size == 128


def test_yaml_config_and_command_line_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"num-layers": 4, "hidden_size": 128, "lev": {"heads": 4, "rank": 16},
                                   "lr": 3e-4, "split": "90,10,0"}))
    a = parse_args(BASE + ["--config", str(cfg), "--num-layers", "6"], world_size=1)
    assert a.num_layers == 6  # the command line wins
    assert a.lr == 1e-3  # BASE gives --lr and --hidden-size on the command line too
    assert a.hidden_size == 64 and a.lev_heads == 4 and a.lev_rank == 16 and a.split == "90,10,0"
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layerz: 3\n")
    with pytest.raises(ConfigError, match="num_layerz"):
        parse_args(BASE + ["--config", str(bad)], world_size=1)
    bad.write_text("num_layers: three\n")
    with pytest.raises(ConfigError, match="--num-layers"):
        parse_args(BASE + ["--config", str(bad)], world_size=1)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    argv = BASE + ["--global-batch-size", "8", "--input-embedding", "lev", "--lev-compute-mode", "table",
                   "--tensor-model-parallel-size", "2", "--bf16", "--lr-decay-style", "cosine",
                   "--lr-warmup-iters", "2", "--data-cache-path", str(tmp_path)]
    first = resolved_config(parse_args(argv, world_size=4))
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(first))
    # The saved file alone reproduces the run's arguments.
    again = resolved_config(parse_args(["--config", str(path)], world_size=4))
    assert again == first
    assert yaml.safe_load(path.read_text()) == first
    # A checkpoint's config.yaml also holds derived values, the tokenizer fingerprint a mapping among them.
    saved = dict(first, tokenizer_fingerprint={"type": "GPT2BPETokenizer", "vocab_size": 4000,
                                               "files": ["vocab.json", "merges.txt"], "sha256": "00"})
    path.write_text(config_to_yaml(saved))
    assert resolved_config(parse_args(["--config", str(path)], world_size=4)) == first


@pytest.mark.parametrize("extra, world, flag", [
    (["--global-batch-size", "6"], 4, "--global-batch-size"),
    (["--tensor-model-parallel-size", "3"], 4, "--tensor-model-parallel-size"),
    (["--num-attention-heads", "3", "--tensor-model-parallel-size", "2"], 2, "--num-attention-heads"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers"),
    (["--bf16", "--fp16"], 1, "--bf16"),
    (["--save-interval", "5"], 1, "--save-interval"),
    (["--lr-warmup-iters", "10"], 1, "--lr-warmup-iters"),
    (["--input-embedding", "lev", "--lev-heads", "3", "--tensor-model-parallel-size", "2"], 2, "--lev-heads"),
    (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size", "2",
      "--global-batch-size", "6"], 2, "--pipeline-model-parallel-size"),
    # MTP sits on the last stage, an own input arm on the first: refused here, not in rank 1's model build
    (["--input-embedding", "lev", "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"], 2,
     "--mtp-num-layers with --input-embedding lev"),
])
def test_invalid_combinations_name_the_flag(extra, world, flag):
    with pytest.raises(ConfigError) as e:
        parse_args(BASE + extra, world_size=world)
    msg = str(e.value)
    assert flag in msg and "\n" not in msg


def test_missing_data_and_tokenizer_files(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    no_data = [x for x in BASE if x != "--mock-data"]
    with pytest.raises(ConfigError, match="--data-path"):
        parse_args(no_data, world_size=1)
    with pytest.raises(ConfigError, match="--vocab-file"):
        parse_args(no_data + ["--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer"], world_size=1)
    with pytest.raises(ConfigError, match="--lr"):
        parse_args([x for x in BASE if x not in ("--lr", "1e-3")], world_size=1)
    # a hub id (Megatron-LM downloads it) is named as one, with the offline way to a local path
    hf = BASE + ["--tokenizer-type", "HuggingFaceTokenizer"]
    with pytest.raises(ConfigError, match=r"--tokenizer-model some-org/some-model: no such file; it looks like a "
                                          r"Hugging Face hub id, and no local copy is in the Hugging Face cache "
                                          rf"{tmp_path / 'hub'} \(HF_HUB_CACHE or HF_HOME\): .*--local-dir"):
        parse_args(hf + ["--tokenizer-model", "some-org/some-model"], world_size=1)
    # where `huggingface-cli download` put it, the cached copy of the main revision is used
    repo = tmp_path / "hub" / "models--some-org--some-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "tokenizer.json").write_text("{}")
    a = parse_args(hf + ["--tokenizer-model", "some-org/some-model"], world_size=1)
    assert a.tokenizer_model == str(repo / "snapshots" / "abc123" / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"--tokenizer-model missing/tok.json: no such file$"):
        parse_args(hf + ["--tokenizer-model", "missing/tok.json"], world_size=1)


def _cli(args, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # Earlier in-process tests (evaluation) may have set a rendezvous address that this process still holds.
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(env_extra or {})
    return run_cli(REPO / "pretrain_lev.py", args, env=env, timeout=120, cwd=str(REPO))


def test_cli_errors_are_one_line_without_traceback(tok_args, tmp_path):
    # Batch size not divisible at world size 2 (validated before any process group exists).
    r = _cli(BASE + ["--global-batch-size", "3"], {"WORLD_SIZE": "2"})
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "--global-batch-size" in err[0], r.stderr
    assert "Traceback" not in r.stderr
    # A data prefix that does not exist: named, at start-up, no traceback.
    no_data = [x for x in BASE if x not in ("--mock-data", "--vocab-size", "255")]
    r = _cli(no_data + ["--data-path", str(tmp_path / "missing_text_document"), *tokenizer_flags(tok_args["gpt2"])])
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "missing_text_document" in err[0], r.stderr
    assert "Traceback" not in r.stderr


def test_lev_flags_are_the_config_fields():
    """Every LEVConfig field is a flag with the field's type, default and choices (generated from the
    dataclass); the parsed flags give back the dataclass defaults."""
    from dataclasses import fields

    from megatron_lev.arguments import build_parser
    from megatron_lev.lev.config import BASIS_KINDS, COMPUTE_MODES, LEVConfig, lev_arg, lev_flag

    actions = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    for f in fields(LEVConfig):
        action = actions.get(lev_flag(f.name))
        assert action is not None, f"LEVConfig.{f.name} has no flag"
        assert action.dest == lev_arg(f.name) and action.default == f.default
        assert action.choices == f.metadata.get("choices") and action.help
    assert actions["--lev-basis"].choices == BASIS_KINDS and actions["--lev-compute-mode"].choices == COMPUTE_MODES
    assert lev_flag("num_heads") == "--lev-heads" and lev_flag("seed_dim") == "--lev-seed-dim"
    args = parse_args(BASE, world_size=1)
    assert LEVConfig.from_args(vars(args)) == LEVConfig()


def test_model_flags_are_the_model_config_fields():
    from megatron_lev.arguments import build_parser
    from megatron_lev.models.config import INPUT_EMBEDDINGS, TRANSFORMER_IMPLS, LevModelConfig

    actions = {a.dest: a for a in build_parser()._actions}
    assert actions["input_embedding"].choices == INPUT_EMBEDDINGS
    assert actions["input_embedding"].default is None  # resolved from --untie-embeddings-and-output-weights
    assert actions["transformer_impl"].choices == TRANSFORMER_IMPLS
    defaults = LevModelConfig(vocab_size=2, max_sequence_length=1)
    for name in ("albert_dim", "flat_mlp_dim", "mlp_hidden", "rotary_base", "rotary_percent", "transformer_impl"):
        assert actions[name].default == getattr(defaults, name), name


def test_a_field_without_a_command_line_form_is_refused():
    import argparse
    from dataclasses import dataclass, field

    from megatron_lev.config_flags import add_config_flags

    @dataclass
    class WithList:
        widths: list = field(default_factory=list)
        """Not a scalar: no flag form."""

    with pytest.raises(TypeError, match="WithList.widths"):
        add_config_flags(argparse.ArgumentParser(), WithList, lambda n: f"--{n}")


def test_parsers_can_be_built_from_several_threads_at_once(monkeypatch):
    # Conversions build the training parser in worker threads. The field docstrings behind the generated
    # flags are read from source with ast, which CPython 3.11 cannot run from several threads at once
    # ("AST constructor recursion depth mismatch"): at most one thread may be reading at any time.
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from megatron_lev import config_flags
    from megatron_lev.arguments import build_parser

    inside, most, lock = [0], [0], threading.Lock()
    parse = config_flags.ast.parse

    def slow_parse(*a, **kw):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # give the other threads every chance to overlap
        try:
            return parse(*a, **kw)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(config_flags.ast, "parse", slow_parse)
    config_flags._field_docs.cache_clear()
    config_flags._module_classes.cache_clear()
    with ThreadPoolExecutor(8) as pool:
        helps = list(pool.map(lambda _: build_parser().format_help(), range(16)))
    assert most[0] == 1
    assert len(set(helps)) == 1 and "--lev-heads" in helps[0]


def _numeric_flags(parser):
    from megatron_lev.config_flags import Number

    return [a for a in parser._actions if a.option_strings and (isinstance(a.type, Number) or a.type in (int, float))]


def test_every_numeric_flag_has_its_range_checked_at_parse_time(capsys):
    """Each numeric flag is given 0, -1, nan and inf: refused in one line naming the flag, or accepted where
    the range its --help states allows the value (the issue's cases among them: a negative MTP depth or
    loss scale, zero expert widths and counts, a NaN learning rate all reached megatron-core before)."""
    import math

    from megatron_lev.arguments import build_parser, validate_args
    from megatron_lev.config_flags import Number
    from megatron_lev.training import loop

    parser = build_parser()
    numeric = _numeric_flags(parser)
    assert len(numeric) > 90
    untyped = [a.option_strings[0] for a in numeric if not isinstance(a.type, Number)]
    assert not untyped, f"numeric flags without a range: {untyped}"
    wrong = []
    for action in numeric:
        flag = action.option_strings[0]
        rng = action.type
        assert action.help == "==SUPPRESS==" or action.help.endswith(f"[{rng.describe()}]"), (flag, action.help)
        for text in ("0", "-1", "nan", "inf"):
            argv = [x for x in BASE]
            if flag in argv:
                argv[argv.index(flag) + 1] = text
            else:
                argv += [flag] + [text] * (action.nargs if isinstance(action.nargs, int) else 1)
            try:
                validate_args(parser.parse_args(argv), world_size=1)
            except ConfigError as e:
                if flag not in str(e) or "\n" in str(e):
                    wrong.append((flag, text, f"refused without naming the flag: {e}"))
                continue
            value = float(text)
            if not rng.allows(rng.kind(value) if not math.isnan(value) and not math.isinf(value) else value):
                wrong.append((flag, text, f"accepted outside its range {rng.describe()}"))
    assert not wrong, wrong
    # The range checks run inside argparse: a --config file's value is checked alike, naming the flag.
    # And on the command line, pretrain_lev.py ends in one line with exit 2, before any model is built.
    capsys.readouterr()
    assert loop.pretrain(BASE + ["--mtp-num-layers", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mtp-num-layers" in err[0] and ">= 1" in err[0], err


def test_a_config_file_value_outside_its_range_is_refused(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"num-experts": 0}))
    with pytest.raises(ConfigError, match=r"--num-experts .*>= 1"):
        parse_args(BASE + ["--config", str(cfg)], world_size=1)
    cfg.write_text(yaml.safe_dump({"lr": float("nan")}))
    with pytest.raises(ConfigError, match="--lr"):
        parse_args([x for x in BASE if x not in ("--lr", "1e-3")] + ["--config", str(cfg)], world_size=1)


def test_a_numeric_field_without_a_range_is_refused():
    import argparse
    from dataclasses import dataclass

    from megatron_lev.config_flags import add_config_flags

    @dataclass
    class NoRange:
        width: int = 4
        """A size without its valid range."""

    with pytest.raises(TypeError, match="NoRange.width: a numeric flag needs its range"):
        add_config_flags(argparse.ArgumentParser(), NoRange, lambda n: f"--{n}")
    parser = argparse.ArgumentParser()
    add_config_flags(parser, NoRange, lambda n: f"--{n}", ranges={"width": {"min": 1}})
    assert parser.parse_args(["--width", "3"]).width == 3


def test_output_directories_are_checked_before_any_work(tmp_path):
    (tmp_path / "afile").write_text("x")
    for flag in ("--save", "--tensorboard-dir", "--wandb-save-dir", "--data-cache-path"):
        needs = ["--wandb-project", "p"] if flag == "--wandb-save-dir" else []
        for path, why in ((tmp_path / "afile" / "out", "is a file"), ("/proc/self/out", "cannot write in /proc/self")):
            with pytest.raises(ConfigError) as e:
                parse_args(BASE + needs + [flag, str(path)], world_size=1)
            msg = str(e.value)
            assert msg.startswith(f"{flag} {path}: cannot write in") and why in msg and "\n" not in msg, msg
    # a directory that does not exist yet is checked in the folder it will be made in, and made later
    args = parse_args(BASE + ["--save", str(tmp_path / "new" / "ckpt")], world_size=1)
    assert args.save.endswith("ckpt") and not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == [tmp_path / "afile"]


def test_a_config_file_list_for_a_single_value_or_a_key_given_twice_is_refused_in_one_line(tmp_path):
    cfg = tmp_path / "run.yaml"
    cases = {
        "save: [a, b]\n": "save: invalid value ['a', 'b'] for --save (expected one value, not a list)",
        "num_layers: [2]\n": "num_layers: invalid value [2] for --num-layers (expected one value, not a list)",
        "split: [90, 10, 0]\n": "split: invalid value [90, 10, 0] for --split (expected one value, not a list)",
        "num_layers: 2\nlr: 0.1\nnum_layers: 4\n": "'num_layers' is given twice (lines 1 and 3); keep one",
        "lev:\n  heads: 2\n  heads: 4\n": "'heads' is given twice (lines 2 and 3); keep one",
        "num_layers: 2\nnum-layers: 4\n": "'num_layers' and 'num-layers' both set --num-layers; keep one",
        "--num-layers: 2\nnum_layers: 4\n": "'--num-layers' and 'num_layers' both set --num-layers; keep one",
        "lev:\n  heads: 2\nlev_heads: 4\n": "'lev.heads' and 'lev_heads' both set --lev-heads; keep one",
    }
    for text, why in cases.items():
        cfg.write_text(text)
        with pytest.raises(ConfigError) as e:
            parse_args(BASE + ["--config", str(cfg)], world_size=1)
        assert str(e.value) == f"--config {cfg}: {why}", (text, str(e.value))
    from megatron_lev.arguments import build_parser, load_yaml_config

    cfg.write_text("data_path: [a, b]\nlev: {heads: 4}\n")  # a list flag takes a list; one spelling each
    assert load_yaml_config(str(cfg), build_parser()) == {"data_path": ["a", "b"], "lev_heads": 4}
