"""Hugging Face export of Megatron-LM's other model families, and lm-eval on an export.

Tiny models (2 layers, hidden 64) are built at TP=1 with every parameter random (norm scales and biases
too) and saved by the training checkpointer, all in one launch: GPT-3-style (LayerNorm, GeLU, biases,
learned positions; tied, with the test BPE's tokenizer.json), the same untied with ``--apply-layernorm-1p``
and ``--disable-bias-linear``, and Mixtral-style MoE (4 experts, top-2; untied with grouped-query attention,
and tied with ``--apply-layernorm-1p`` and an expert size of its own). Each export loads in ``transformers``
as GPT2LMHeadModel / MixtralForCausalLM with the logits of the project's own forward on the same tokens
(fp32, 1e-5). The GPT-3-style export then runs through lm-eval's HF adapter (``HFLM``, offline) on a
handmade LAMBADA-style task and gives the log-likelihoods and the number of ``tools/evaluate.py`` on the
checkpoint and on the export. A tiny Llama-3.1-style model (``rope_type llama3``) imports with
``--use-rope-scaling`` and exports back, with transformers' logits both ways.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_lev.testing.cli import run_cli

# One launch saves the models, then four exports, two evaluations, an import and an export (~115 s for the
# module on a busy 2-core machine): not in make test-fast.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EVALUATE = str(REPO / "tools" / "evaluate.py")
SHAPE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
         "--train-iters 4 --lr 1e-3 --mock-data --hidden-dropout 0 --attention-dropout 0").split()
LLAMA = "--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope".split()
MOE = LLAMA + "--num-experts 4 --moe-router-topk 2".split()
MODELS = {  # name: (flags after SHAPE, the HF class)
    "gpt_tied": ([], "GPT2LMHeadModel"),
    "gpt_untied_1p_nobias": ("--input-embedding untied --apply-layernorm-1p --disable-bias-linear --vocab-size 200".split(),
                             "GPT2LMHeadModel"),
    "moe_untied_gqa": (MOE + "--input-embedding untied --group-query-attention --num-query-groups 2 --vocab-size 200".split(),
                       "MixtralForCausalLM"),
    "moe_tied_1p": (MOE + "--apply-layernorm-1p --moe-ffn-hidden-size 48 --vocab-size 200".split(), "MixtralForCausalLM"),
}
SENTENCES = [  # a handmade LAMBADA: the last word is the continuation
    "The old man walked to the river every morning to watch the boats",
    "She opened the door and the cold wind filled the room",
    "After the long game the players were tired and hungry",
    "He wrote a letter to his mother and sent it by post",
    "The children played in the park until the sun went down",
    "We bought bread and milk at the small shop near the station",
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def exported(tok_args, tmp_path_factory):
    """{name: (checkpoint, export dir, export result)} of MODELS, and the token ids the logits are of."""
    from megatron_lev.conversion import export_hf
    from megatron_lev.conversion.launch import run_ranks
    from megatron_lev.tokenizer import build_tokenizer
    from tests.conftest import tokenizer_flags
    from tests.conversion._ranks import model_args, save_random_models

    root = tmp_path_factory.mktemp("hf_classes")
    tok = tokenizer_flags(tok_args["hf"])
    plan = [(str(root / name), model_args(SHAPE + flags + ([] if "--vocab-size" in flags else tok)))
            for name, (flags, _cls) in MODELS.items()]
    t0 = time.time()
    run_ranks(save_random_models, args=(plan,))
    ids = build_tokenizer(**tok_args["hf"]).tokenize(" ".join(SENTENCES[:2]))[:20]
    ref = torch.tensor([ids, [i % 200 for i in ids[::-1]]])
    small = torch.remainder(ref, 200)

    def export(name):
        ids = ref if name == "gpt_tied" else small
        return export_hf(root / name, root / f"{name}_hf", reference_ids=ids.tolist(), progress=False)

    with ThreadPoolExecutor(2) as ex:
        results = dict(zip(MODELS, ex.map(export, MODELS)))
    print(f"[hf classes] save + exports: {time.time() - t0:.0f} s", file=sys.stderr)
    return {"root": root, "results": results, "ids": {n: ref if n == "gpt_tied" else small for n in MODELS}}


@pytest.mark.parametrize("name", list(MODELS))
def test_export_loads_in_transformers_with_the_models_logits(exported, name):
    from transformers import AutoModelForCausalLM

    out = exported["root"] / f"{name}_hf"
    flags, cls = MODELS[name]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [cls] and exported["results"][name]["hf_class"] == cls
    assert cfg["tie_word_embeddings"] is ("untied" not in name)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(model).__name__ == cls
    if cls == "MixtralForCausalLM":
        assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (4, 2)
        if "--moe-ffn-hidden-size" in flags:  # the experts' own size, not --ffn-hidden-size
            assert cfg["intermediate_size"] == 48
        assert cfg["num_key_value_heads"] == (2 if "gqa" in name else 4)
    else:
        assert cfg["n_positions"] == 64 and cfg["activation_function"] == "gelu"
    ids = exported["ids"][name]
    with torch.no_grad():
        hf = model(ids).logits
    ref = torch.from_numpy(exported["results"][name]["logits"])
    assert hf.shape == ref.shape and ref.abs().max() > 0.5
    torch.testing.assert_close(hf, ref, atol=1e-5, rtol=0)


def test_exported_tokenizer_names_eos_bos_and_pad(exported, tok_args):
    """The checkpoint's tokenizer.json (no special tokens declared) gets eos = bos = pad = its end of
    document, as lm-eval's ``hf`` model and ``generate`` need."""
    from transformers import AutoTokenizer

    from megatron_lev.tokenizer import build_tokenizer

    out = exported["root"] / "gpt_tied_hf"
    eod = build_tokenizer(**tok_args["hf"]).eod
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (eod, eod, eod)
    assert cfg["eos_token"] == cfg["bos_token"] == cfg["pad_token"] == tok.convert_ids_to_tokens(eod)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["bos_token_id"]) == (eod, eod)


def test_lm_eval_hf_adapter_gives_the_projects_numbers(exported, tmp_path):
    """lm-eval's HFLM on the export: its log-likelihoods of the handmade task's requests equal
    tools/evaluate.py's on the checkpoint (perplexity over the continuations to 1e-5 relative, greedy
    matches equal), and tools/evaluate.py --hf-model on the export gives the same."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    task = tmp_path / "lambada.jsonl"
    task.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    root = exported["root"]
    numbers = {}
    for name, model in (("checkpoint", ["--load", root / "gpt_tied"]), ("hf", ["--hf-model", root / "gpt_tied_hf"])):
        r = run_cli(EVALUATE, model + ["--task-file", f"lambada={task}", "--output-dir", tmp_path / name,
                                       "--no-progress", "--device", "cpu"], env=_env(), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        numbers[name] = json.loads((tmp_path / name / "results.json").read_text())["tasks"]["lambada"]
    ours = numbers["checkpoint"]

    lm = HFLM(pretrained=str(root / "gpt_tied_hf"), backend="causal", device="cpu", dtype="float32", batch_size=4)
    requests = [Instance(request_type="loglikelihood", doc={"text": s}, arguments=tuple(s.rsplit(" ", 1)[0:1])
                         + (" " + s.rsplit(" ", 1)[1],), idx=0) for s in SENTENCES]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    lls = torch.tensor([ll for ll, _greedy in results], dtype=torch.float64)
    ppl = float(torch.exp(-lls.mean()))
    acc = sum(bool(greedy) for _ll, greedy in results) / len(results)
    assert ours["examples"] == len(SENTENCES) and ours["ppl"] > 1  # a random model: a large perplexity
    assert ppl == pytest.approx(ours["ppl"], rel=1e-5) and float(lls.mean()) == pytest.approx(ours["mean_loglik"], abs=1e-5)
    assert acc == ours["acc"]
    assert numbers["hf"]["ppl"] == pytest.approx(ours["ppl"], rel=1e-5) and numbers["hf"]["acc"] == ours["acc"]
    # An empty context is conditioned on lm-eval's prefix token: the tokenizer's bos (None before: TypeError).
    (empty, _greedy), = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=("", " The old man"),
                                                   idx=0)], disable_tqdm=True)
    ids = [lm.tokenizer.bos_token_id] + lm.tokenizer.encode(" The old man", add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    assert empty == pytest.approx(float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum()), abs=1e-5)


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama31(out: Path, rope_scaling):
    """A tiny Llama-3.1-style model (rope_theta 500000, llama3 RoPE scaling) saved with its config.json as the
    hub's Llama 3.1 has it (``rope_theta`` and ``rope_scaling`` at the top level)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, rope_scaling=rope_scaling)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 if p.dim() > 1 else 1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(out))
    saved = json.loads((out / "config.json").read_text())
    saved.pop("rope_parameters", None)
    saved.update(rope_theta=500000.0, rope_scaling=rope_scaling)
    (out / "config.json").write_text(json.dumps(saved))
    return model


def test_llama31_rope_scaling_imports_and_exports_with_transformers_logits(tmp_path):
    """A Llama 3.1 config (rope_type llama3) imports as --use-rope-scaling --rope-scaling-factor 8; the
    imported checkpoint's forward equals transformers' (1e-5), and its export writes the scaling back with the
    same logits. At these sizes the scaling moves the logits well past the tolerance (checked)."""
    import yaml
    from transformers import AutoModelForCausalLM

    from megatron_lev.conversion import export_hf, import_hf

    hf = _llama31(tmp_path / "hf", LLAMA31_ROPE)
    ids = torch.remainder(torch.arange(120).reshape(2, 60) * 37 + 11, 200)
    with torch.no_grad():
        ref = hf(ids).logits
        unscaled = _llama31(tmp_path / "plain", None)(ids).logits
    assert (unscaled - ref).abs().max() > 1e-3
    out = import_hf(tmp_path / "hf", tmp_path / "ck", progress=False)
    saved = yaml.safe_load((Path(out) / "config.yaml").read_text())
    assert (saved["use_rope_scaling"], saved["rope_scaling_factor"], saved["rotary_base"]) == (True, 8.0, 500000)
    res = export_hf(tmp_path / "ck", tmp_path / "back", reference_ids=ids.tolist(), progress=False)
    torch.testing.assert_close(torch.from_numpy(res["logits"])[..., :200], ref, atol=1e-5, rtol=0)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    rope = back.get("rope_scaling") or back.get("rope_parameters")
    assert {k: rope[k] for k in LLAMA31_ROPE} == LLAMA31_ROPE
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :200], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope_scaling, named", [
    ({**LLAMA31_ROPE, "high_freq_factor": 2.0}, "rope_scaling high_freq_factor 2.0"),
    ({**LLAMA31_ROPE, "original_max_position_embeddings": 4096}, "rope_scaling original_max_position_embeddings 4096"),
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
])
def test_rope_scaling_megatron_cannot_reproduce_is_refused_in_one_line(tmp_path, rope_scaling, named):
    from megatron_lev.conversion import ConversionError, read_hf_model

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 200, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": 500000.0,
           "rope_scaling": rope_scaling}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError) as e:
        read_hf_model(str(tmp_path))
    assert named in str(e.value) and "\n" not in str(e.value)
