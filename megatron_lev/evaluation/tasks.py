"""LAMBADA and multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness (0.4) does.

Requests are (context, continuation) string pairs. Encoding follows lm-eval's ``_encode_pair``:
trailing spaces of the context move to the continuation, the concatenation is tokenised once and
the continuation's tokens are those after the context's own tokens; an empty context becomes the
end-of-document token. Inputs longer than the model's window keep their last ``max_length + 1``
tokens. The log-likelihood of a continuation is the sum of its tokens' log-probs; "greedy" means
every continuation token is the argmax.

Task formats (the original Hugging Face field names; files in ``../shared/data/downstream``):

- LAMBADA (OpenAI), ``{"text"}``: context = all but the last space-separated word, continuation =
  ``" " + last word`` (lm-eval's ``lambada_openai``). Metrics: ``acc`` (greedy match of the whole
  word) and ``ppl`` = exp(-mean over examples of the word's log-likelihood), lm-eval's
  ``perplexity`` aggregation.
- HellaSwag, ``{"activity_label", "ctx_a", "ctx_b", "endings", "label"}``: query =
  preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()), choices =
  preprocess(ending); preprocess strips, turns " [title]" into ". ", removes ``[...]``, collapses
  double spaces (lm-eval's ``hellaswag/utils.py``).
- PIQA, ``{"goal", "sol1", "sol2", "label"}``: "Question: {goal}\\nAnswer:" + " " + sol.
- ARC-Easy / ARC-Challenge, ``{"question", "choices": {"text", "label"}, "answerKey"}``:
  "Question: {question}\\nAnswer:" + " " + choice; gold = choices.label.index(answerKey).
- WinoGrande, ``{"sentence", "option1", "option2", "answer"}``: partial evaluation — for each
  option the context is the sentence up to "_" with the option filled in, and the continuation is
  " " + the (stripped) rest of the sentence after "_", which is the same for both options.

Metrics (lm-eval's names and definitions): ``acc`` = argmax of the summed log-likelihood;
``acc_norm`` = argmax of log-likelihood / number of *characters* of the choice text (without the
leading space) — lm-eval's code, which the issue's "byte length" equals on ASCII text;
``acc_bytes`` = the same with UTF-8 bytes. WinoGrande reports ``acc`` only (its continuation is
shared, as in lm-eval). Differences from lm-eval: no few-shot, no request caching/reordering
beyond length sorting; lm-eval's greedy check and ours differ only on exact ties of the top logit;
Megatron models score over the padded vocabulary (as their training loss does); documents come
from local jsonl files instead of ``datasets``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_lev.progress import Progress

from .perplexity import DataFormatError, iter_json_objects
from .scorer import PROGRESS_SECONDS, Scorer, scoring_progress

# ------------------------------------------------------------------------------------------------
# reading task files


def read_jsonl(path: str, limit: Optional[int] = None) -> List[Tuple[int, Dict[str, Any]]]:
    """(line number, object) of each non-empty line; bad JSON is a DataFormatError naming file:line."""
    if not os.path.isfile(path):
        raise DataFormatError(f"{path}: no such task file")
    out = []
    for lineno, obj in iter_json_objects(path):
        if limit is not None and len(out) >= limit:
            break
        out.append((lineno, obj))
    if not out:
        raise DataFormatError(f"{path}: no examples")
    return out


def _field(obj: Dict[str, Any], key: str, kind, where: str):
    if key not in obj:
        raise DataFormatError(f"{where}: missing field {key!r}")
    v = obj[key]
    if not isinstance(v, kind):
        raise DataFormatError(f"{where}: field {key!r} should be {getattr(kind, '__name__', kind)}, got {type(v).__name__}")
    return v


# ------------------------------------------------------------------------------------------------
# examples


@dataclass
class MCExample:
    contexts: List[str]  # one per choice (the same string repeated except for WinoGrande)
    continuations: List[str]  # one per choice, with the leading delimiter
    choice_texts: List[str]  # for the length normalisation
    gold: int


def hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _hellaswag(obj, where) -> MCExample:
    ctx = _field(obj, "ctx_a", str, where) + " " + _field(obj, "ctx_b", str, where).capitalize()
    query = hellaswag_preprocess(_field(obj, "activity_label", str, where) + ": " + ctx)
    endings = _field(obj, "endings", list, where)
    choices = [hellaswag_preprocess(e) for e in endings]
    return _mc([query] * len(choices), choices, _gold(obj, "label", len(choices), where), where)


def _piqa(obj, where) -> MCExample:
    query = f"Question: {_field(obj, 'goal', str, where)}\nAnswer:"
    choices = [_field(obj, "sol1", str, where), _field(obj, "sol2", str, where)]
    return _mc([query] * 2, choices, _gold(obj, "label", 2, where), where)


def _arc(obj, where) -> MCExample:
    query = f"Question: {_field(obj, 'question', str, where)}\nAnswer:"
    ch = _field(obj, "choices", dict, where)
    texts, labels = ch.get("text"), ch.get("label")
    if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels) or not texts:
        raise DataFormatError(f"{where}: field 'choices' needs lists 'text' and 'label' of the same length")
    key = _field(obj, "answerKey", str, where)
    if key not in labels:
        raise DataFormatError(f"{where}: answerKey {key!r} is not one of the labels {labels}")
    return _mc([query] * len(texts), texts, labels.index(key), where)


def _winogrande(obj, where) -> MCExample:
    sentence = _field(obj, "sentence", str, where)
    if "_" not in sentence:
        raise DataFormatError(f"{where}: field 'sentence' has no '_' blank")
    options = [_field(obj, "option1", str, where), _field(obj, "option2", str, where)]
    answer = str(_field(obj, "answer", (str, int), where))
    if answer not in ("1", "2"):
        raise DataFormatError(f"{where}: field 'answer' should be '1' or '2', got {answer!r}")
    idx = sentence.index("_")
    target = sentence[idx + 1:].strip()
    contexts = [sentence[:idx] + o for o in options]
    return MCExample(contexts=contexts, continuations=[" " + target] * 2, choice_texts=[target] * 2,
                     gold=int(answer) - 1)


def _mc(contexts, choices, gold, where) -> MCExample:
    if not all(isinstance(c, str) for c in choices):
        raise DataFormatError(f"{where}: every choice should be a string")
    return MCExample(contexts=list(contexts), continuations=[" " + c for c in choices], choice_texts=list(choices),
                     gold=gold)


def _gold(obj, key, n, where) -> int:
    if key not in obj:
        raise DataFormatError(f"{where}: missing field {key!r}")
    try:
        g = int(obj[key])
    except (TypeError, ValueError):
        raise DataFormatError(f"{where}: field {key!r} should be an integer, got {obj[key]!r}") from None
    if not 0 <= g < n:
        raise DataFormatError(f"{where}: field {key!r} = {g} is out of range for {n} choices")
    return g


MC_TASKS: Dict[str, Tuple[str, Callable, Tuple[str, ...]]] = {
    # name: (default file name in the downstream folder, parser, metrics)
    "hellaswag": ("hellaswag_validation.jsonl", _hellaswag, ("acc", "acc_norm", "acc_bytes")),
    "piqa": ("piqa_validation.jsonl", _piqa, ("acc", "acc_norm", "acc_bytes")),
    "winogrande": ("winogrande_xl_validation.jsonl", _winogrande, ("acc",)),
    "arc_easy": ("arc_easy_validation.jsonl", _arc, ("acc", "acc_norm", "acc_bytes")),
    "arc_challenge": ("arc_challenge_validation.jsonl", _arc, ("acc", "acc_norm", "acc_bytes")),
}
LAMBADA_FILE = "lambada_openai_test.jsonl"
ALL_TASKS = ("lambada",) + tuple(MC_TASKS)


def load_mc_examples(task: str, path: str, limit: Optional[int] = None) -> List[MCExample]:
    if task not in MC_TASKS:
        raise ValueError(f"unknown multiple-choice task {task!r} (choose from {', '.join(MC_TASKS)})")
    parse = MC_TASKS[task][1]
    return [parse(obj, f"{path}:{lineno}") for lineno, obj in read_jsonl(path, limit)]


def load_lambada(path: str, limit: Optional[int] = None) -> List[Tuple[str, str]]:
    out = []
    for lineno, obj in read_jsonl(path, limit):
        text = _field(obj, "text", str, f"{path}:{lineno}")
        words = text.split(" ")
        if len(words) < 2 or not words[-1]:
            raise DataFormatError(f"{path}:{lineno}: field 'text' needs at least two space-separated words")
        out.append((" ".join(words[:-1]), " " + words[-1]))
    return out


# ------------------------------------------------------------------------------------------------
# log-likelihood requests


def encode_pair(tokenizer, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """lm-eval's ``_encode_pair`` for causal models (empty context -> [EOD])."""
    if not context:
        return [tokenizer.eod], list(tokenizer.tokenize(continuation))
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = list(tokenizer.tokenize(context + continuation))
    ctx = list(tokenizer.tokenize(context))
    return ctx, whole[len(ctx):]


def loglikelihood(scorer: Scorer, tokenizer, requests: Sequence[Tuple[str, str]], progress: Optional[Progress] = None
                  ) -> List[Tuple[float, bool]]:
    """(sum of log-probs of the continuation, every continuation token is the argmax) per request; ``progress``
    counts the requests scored."""
    seqs, conts = [], []
    for ctx, cont in requests:
        c_enc, k_enc = encode_pair(tokenizer, ctx, cont)
        if not k_enc:
            raise ValueError(f"continuation {cont!r} encodes to no tokens")
        whole = (c_enc + k_enc)[-(scorer.max_length + 1):]
        n = min(len(k_enc), len(whole) - 1)
        seqs.append(whole)
        conts.append(n)
    scores = scorer.score(seqs, progress=progress)
    return [(float(s.logprobs[-n:].sum()), bool(s.greedy[-n:].all())) for s, n in zip(scores, conts)]


def evaluate_lambada(scorer: Scorer, tokenizer, path: str, limit: Optional[int] = None,
                     progress: bool = True, requests: Optional[List[Tuple[str, str]]] = None,
                     progress_seconds: float = PROGRESS_SECONDS) -> Dict[str, Any]:
    reqs = requests if requests is not None else load_lambada(path, limit)
    with scoring_progress(scorer, "lambada", total=len(reqs), enabled=progress, seconds=progress_seconds) as shown:
        res = loglikelihood(scorer, tokenizer, reqs, progress=shown)
    lls = np.array([r[0] for r in res])
    acc = np.array([r[1] for r in res], dtype=np.float64)
    return {"examples": len(reqs), "acc": float(acc.mean()), "acc_stderr": _stderr(acc),
            "ppl": float(math.exp(-lls.mean())), "mean_loglik": float(lls.mean()), "file": path}


def evaluate_multiple_choice(scorer: Scorer, tokenizer, task: str, path: str, limit: Optional[int] = None,
                             progress: bool = True, examples: Optional[List[MCExample]] = None,
                             progress_seconds: float = PROGRESS_SECONDS) -> Dict[str, Any]:
    examples = examples if examples is not None else load_mc_examples(task, path, limit)
    reqs, spans = [], []
    for ex in examples:
        spans.append((len(reqs), len(ex.continuations)))
        reqs += list(zip(ex.contexts, ex.continuations))
    with scoring_progress(scorer, task, total=len(reqs), enabled=progress, seconds=progress_seconds) as shown:
        res = loglikelihood(scorer, tokenizer, reqs, progress=shown)
    metrics = MC_TASKS[task][2] if task in MC_TASKS else ("acc", "acc_norm", "acc_bytes")
    hits: Dict[str, List[float]] = {m: [] for m in metrics}
    for ex, (start, n) in zip(examples, spans):
        lls = np.array([res[start + i][0] for i in range(n)])
        chars = np.array([float(len(c)) for c in ex.choice_texts])
        nbytes = np.array([float(len(c.encode("utf-8"))) for c in ex.choice_texts])
        preds = {"acc": int(np.argmax(lls))}
        with np.errstate(divide="ignore", invalid="ignore"):
            preds["acc_norm"] = int(np.argmax(lls / chars))
            preds["acc_bytes"] = int(np.argmax(lls / nbytes))
        for m in metrics:
            hits[m].append(1.0 if preds[m] == ex.gold else 0.0)
    out: Dict[str, Any] = {"examples": len(examples), "file": path}
    for m in metrics:
        arr = np.array(hits[m])
        out[m] = float(arr.mean())
        out[f"{m}_stderr"] = _stderr(arr)
    return out


def _stderr(x: np.ndarray) -> float:
    """Standard error of a mean of 0/1 outcomes (sample standard deviation / sqrt(n), as lm-eval)."""
    n = len(x)
    return float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
