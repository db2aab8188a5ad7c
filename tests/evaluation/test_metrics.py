"""Evaluation maths on scorers whose log-probs the test controls (no Megatron model): windows,
perplexity, frequency buckets, LAMBADA, multiple choice, malformed files, comparison."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from megatron_lev.evaluation import (
    DataFormatError, LogitsScorer, documents_from_path, evaluate_lambada, evaluate_multiple_choice, evaluate_perplexity, iter_windows,
    jsonl_documents, load_mc_examples, parse_edges, spread_indices, stratify, stratify_by_exposure, write_comparison,
    write_report,
)
from megatron_lev.evaluation.tasks import MC_TASKS, encode_pair, loglikelihood


def unigram_scorer(probs: dict, max_length=4096, vocab=256):
    """Context-free model: log p(next = c) fixed; other bytes share the remaining mass."""
    p = np.full(vocab, 0.0)
    for c, v in probs.items():
        p[ord(c) if isinstance(c, str) else c] = v
    rest = (1.0 - p.sum()) / (p == 0).sum()
    p[p == 0] = rest
    logp = torch.tensor(np.log(p), dtype=torch.float32)
    return LogitsScorer(lambda t: logp.expand(t.shape[0], t.shape[1], vocab).clone(), max_length=max_length,
                        vocab_size=vocab), np.log(p)


def bigram_scorer(next_of, max_length=4096, vocab=256):
    """Argmax of the next byte is next_of(current byte) (logit 5 against 0)."""
    table = torch.zeros(vocab, vocab)
    for c in range(vocab):
        table[c, next_of(c)] = 5.0
    return LogitsScorer(lambda t: table[t], max_length=max_length, vocab_size=vocab)


def test_windows_score_every_token_once():
    sizes = [5, 17, 1, 40, 3]
    offsets = np.cumsum([0] + sizes)
    docs = [(np.arange(offsets[i], offsets[i + 1], dtype=np.int64) + 1, n) for i, n in enumerate(sizes)]
    stream = np.concatenate([[0]] + [d for d, _ in docs])  # token value = position in the stream
    for seq, stride in [(8, 8), (8, 3), (8, 1), (64, 64), (7, 5)]:
        seen = []
        stats = {}
        for w, skip in iter_windows(iter(docs), seq, stride, eod=0, stats=stats):
            assert 2 <= len(w) <= seq + 1
            start = int(w[0])
            assert np.array_equal(w, stream[start:start + len(w)])
            targets = list(range(start + 1 + skip, start + len(w)))
            assert targets, (seq, stride)
            if len(w) == seq + 1 and start > 0:
                assert targets[0] - start - 1 >= seq - stride  # at least seq - stride tokens of context
            seen += targets
        assert seen == list(range(1, len(stream))), (seq, stride)
        assert stats == {"documents": 5, "bytes": 66}


def test_perplexity_is_exp_mean_nll_and_stride_invariant_for_context_free_model(tmp_path, byte_tokenizer):
    scorer, logp = unigram_scorer({"e": 0.2, " ": 0.15, "t": 0.1, 0: 0.01})
    texts = ["the tree sees three tents", "a", "", "étoile — naïve test"]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ids = [0] + sum((list(t.encode()) + [0] for t in texts if t), [])
    expect = -np.mean([logp[i] for i in ids[1:]])
    nbytes = sum(len(t.encode()) for t in texts)
    for stride in (None, 4, 1):
        r = evaluate_perplexity(scorer, jsonl_documents([str(path)], byte_tokenizer), eod=0, seq_length=16,
                                stride=stride, progress=False)
        assert r.tokens == len(ids) - 1
        assert r.nll == pytest.approx(expect, rel=1e-6)
        assert r.ppl == pytest.approx(math.exp(expect), rel=1e-6)
        assert r.bytes == nbytes and r.documents == 3  # the empty text is skipped
        assert r.bits_per_byte == pytest.approx(expect * r.tokens / math.log(2) / nbytes, rel=1e-6)
        assert r.count_by_id.sum() == r.tokens and r.nll_by_id.sum() == pytest.approx(r.nll_sum)
    # max_tokens stops at whole documents
    r = evaluate_perplexity(scorer, jsonl_documents([str(path)], byte_tokenizer), eod=0, seq_length=16,
                            max_tokens=5, progress=False)
    assert r.documents == 1 and r.tokens == len(texts[0].encode()) + 1


def test_per_document_nll_adds_up_and_follows_each_document():
    """Each document's summed NLL and target count (its trailing EOD included), under every stride."""
    scorer, logp = unigram_scorer({"a": 0.5, "b": 0.01, 0: 0.1})
    texts = ["aaaaaaaaaaaaaaaaaaaaa", "b", "bbbbbbbbbbbb", "ab"]
    docs = [(np.asarray(list(t.encode()) + [0], dtype=np.int64), len(t)) for t in texts]
    expect = [-sum(logp[i] for i in d) for d, _ in docs]
    for stride in (None, 3, 1):
        r = evaluate_perplexity(scorer, iter(docs), eod=0, seq_length=8, stride=stride, progress=False)
        assert r.tokens_by_doc.tolist() == [len(d) for d, _ in docs]
        assert r.nll_by_doc == pytest.approx(expect, rel=1e-6)
        assert r.nll_by_doc.sum() == pytest.approx(r.nll_sum, rel=1e-9)


def test_a_document_sample_is_spread_over_the_set_at_about_the_tokens_asked(tmp_path, byte_tokenizer):
    lengths = [2, 4] * 5  # 30 tokens
    # 3 documents (0th, 3rd, 6th) hold 2 + 4 + 2 = 8 < 9 tokens: the fewest spread ones that hold 9 are 4
    assert spread_indices(lengths, 9) == [0, 2, 5, 7]
    assert spread_indices(lengths, 1000) == list(range(10))
    with pytest.raises(ValueError, match="at least 1"):
        spread_indices(lengths, 0)
    # A jsonl set: picked by bytes, and only the picked documents are tokenised.
    texts = [chr(97 + i) * (10 if i % 2 else 30) for i in range(20)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    calls = []
    tokenize = byte_tokenizer.tokenize
    byte_tokenizer.tokenize = lambda t: calls.append(t) or tokenize(t)
    try:
        docs = documents_from_path(str(path), byte_tokenizer, sample_tokens=100)
    finally:
        byte_tokenizer.tokenize = tokenize
    got = [chr(int(d[0][0])) for d in docs]
    # 1.05 tokens a byte in the probe: 95 bytes; 4 spread documents hold 80, 5 (0th, 4th, ...) hold 150
    assert got == ["a", "e", "i", "m", "q"] and sum(len(d[0]) for d in docs) == 5 * 31
    assert len(calls) <= 20 + len(docs) and [c[0] for c in calls[-len(docs):]] == got  # the probe, then the picked


def test_exposure_buckets_count_training_occurrences_scaled_to_the_part_trained():
    nll_by_id = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 0.0])
    count_by_id = np.array([1, 1, 2, 2, 4, 8, 0])
    counts = np.array([0, 10, 11, 1000, 1001, 20000])  # id 6 past the counts: never seen
    rows = {b["bucket"]: b for b in stratify_by_exposure(nll_by_id, count_by_id, counts)}
    assert [rows[k]["tokens"] for k in ("never", "1-10", "11-100", "101-1k", "1k-10k", ">10k")] == [1, 1, 2, 2, 4, 8]
    assert rows["11-100"]["nll"] == pytest.approx(2.0) and rows["never"]["vocab_ids"] == 1
    assert sum(b["tokens"] for b in rows.values()) == count_by_id.sum()
    half = {b["bucket"]: b["tokens"] for b in stratify_by_exposure(nll_by_id, count_by_id, counts, scale=0.01)}
    # 0.1 and 0.11 expected sightings round to never; 10 and 10.01 to 1-10; 200 to 101-1k
    assert half == {"never": 1 + 1 + 2, "1-10": 2 + 4, "11-100": 0, "101-1k": 8, "1k-10k": 0, ">10k": 0}
    with pytest.raises(ValueError, match="scale"):
        stratify_by_exposure(nll_by_id, count_by_id, counts, scale=-1)


def test_sliding_windows_give_more_context():
    # A model that is right only with >= 3 tokens of context: sliding windows must score better.
    seq = np.tile(np.array([5, 6, 7, 8], dtype=np.int64), 20)

    def fn(t):
        out = torch.zeros(t.shape[0], t.shape[1], 16)
        for j in range(t.shape[1]):
            if j >= 2:
                out[torch.arange(t.shape[0]), j, 5 + (t[:, j] - 5 + 1) % 4] = 8.0
        return out

    scorer = LogitsScorer(fn, max_length=8, vocab_size=16)
    a = evaluate_perplexity(scorer, iter([(seq, 0)]), eod=0, progress=False)
    b = evaluate_perplexity(scorer, iter([(seq, 0)]), eod=0, stride=2, progress=False)
    assert a.tokens == b.tokens == len(seq)
    assert b.nll < a.nll


def test_buckets_partition_all_tokens():
    rng = np.random.default_rng(0)
    V = 1000
    counts = np.zeros(900, dtype=np.int64)  # ids >= 900 (padding) have no count
    counts[:600] = rng.integers(0, 10**6, 600)
    counts[0] = 10**9
    count_by_id = rng.integers(0, 50, V)
    nll_by_id = rng.random(V) * count_by_id
    for edges in (parse_edges(None), parse_edges("1e-5,1e-3"), (1e-9,)):
        b = stratify(nll_by_id, count_by_id, counts, edges)
        assert len(b) == len(edges) + 1
        assert sum(x["tokens"] for x in b) == count_by_id.sum()
        assert sum((x["nll"] or 0) * x["tokens"] for x in b) == pytest.approx(nll_by_id.sum())
    b = stratify(nll_by_id, count_by_id, counts)
    assert b[0]["bucket"] == "< 1e-7" and b[-1]["bucket"] == "≥ 1e-4"
    freq = np.zeros(V)
    freq[:900] = counts / counts.sum()
    assert b[0]["tokens"] == count_by_id[freq < 1e-7].sum()  # unseen and padding ids land in the first bucket
    assert b[-1]["tokens"] == count_by_id[freq >= 1e-4].sum()
    with pytest.raises(ValueError, match="increasing"):
        parse_edges("1e-4,1e-5")


def test_encode_pair_moves_trailing_space_like_lm_eval(byte_tokenizer):
    assert encode_pair(byte_tokenizer, "ab ", "c") == ([97, 98], [32, 99])
    assert encode_pair(byte_tokenizer, "", "c") == ([0], [99])


def test_lambada_greedy_accuracy_and_word_perplexity(tmp_path):
    from tests.evaluation.conftest import ByteTokenizer

    # After a letter the argmax is ' ', after ' ' it is 'x': " x" is predicted greedily, " y" is not.
    scorer = bigram_scorer(lambda c: ord("x") if c == ord(" ") else ord(" "))
    p = tmp_path / "lambada.jsonl"
    p.write_text(json.dumps({"text": "a b x"}) + "\n" + json.dumps({"text": "a b y"}) + "\n")
    r = evaluate_lambada(scorer, ByteTokenizer(), str(p), progress=False)
    assert r["examples"] == 2 and r["acc"] == 0.5
    lls = [ll for ll, _ in loglikelihood(scorer, ByteTokenizer(), [("a b", " x"), ("a b", " y")])]
    assert r["ppl"] == pytest.approx(math.exp(-np.mean(lls)))
    assert lls[0] > lls[1]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_multiple_choice_picks_the_likelier_continuation(tmp_path, byte_tokenizer):
    # p('x') = 0.6, p(' ') = 0.3, p('q') = 0.05: all-'x' choices are far likelier than others.
    scorer, logp = unigram_scorer({"x": 0.6, " ": 0.3, "q": 0.05})
    files = {
        "hellaswag": _write(tmp_path / "h.jsonl", [
            {"activity_label": "A", "ctx_a": "ctx.", "ctx_b": "he", "endings": ["qqqq", "xxxx", "abcd", "zzzz"], "label": "1"},
            {"activity_label": "B", "ctx_a": "c [title] d", "ctx_b": "", "endings": ["xx", "abab"], "label": 0}]),
        "piqa": _write(tmp_path / "p.jsonl", [{"goal": "g", "sol1": "zzz", "sol2": "xxx", "label": 1}]),
        "arc_easy": _write(tmp_path / "a.jsonl", [
            {"question": "q?", "choices": {"text": ["abc", "xxx", "qq"], "label": ["A", "B", "C"]}, "answerKey": "B"}]),
        "winogrande": _write(tmp_path / "w.jsonl", [
            {"sentence": "The _ is x.", "option1": "xxxx", "option2": "abcd", "answer": "1"},
            {"sentence": "The _ is x.", "option1": "abcd", "option2": "xxxx", "answer": 2}]),
    }
    # WinoGrande scores only the shared suffix: it needs a model that looks at the filled-in option
    # (after 'x' the next byte is ' ' with high probability).
    bigram = bigram_scorer(lambda c: ord(" ") if c == ord("x") else ord("#"))
    for task, path in files.items():
        r = evaluate_multiple_choice(bigram if task == "winogrande" else scorer, byte_tokenizer, task, path,
                                     progress=False)
        assert r["acc"] == 1.0, (task, r)
        assert set(MC_TASKS[task][2]) <= set(r)
    # acc vs acc_norm: one 'q' (ll -3.0) beats forty 'x' (ll -20.4) in total but not per character.
    path = _write(tmp_path / "n.jsonl", [{"goal": "g", "sol1": "q", "sol2": "x" * 40, "label": 1}])
    r = evaluate_multiple_choice(scorer, byte_tokenizer, "piqa", path, progress=False)
    assert r["acc"] == 0.0 and r["acc_norm"] == 1.0 and r["acc_bytes"] == 1.0
    # The requests are lm-eval's.
    ex = load_mc_examples("hellaswag", files["hellaswag"])
    assert ex[0].contexts[0] == "A: ctx. He" and ex[0].continuations[1] == " xxxx" and ex[0].gold == 1
    assert ex[1].contexts[0] == "B: c. d" and ex[1].gold == 0
    ex = load_mc_examples("winogrande", files["winogrande"])
    assert ex[0].contexts == ["The xxxx", "The abcd"] and ex[0].continuations == [" is x.", " is x."]
    ex = load_mc_examples("piqa", files["piqa"])
    assert ex[0].contexts[0] == "Question: g\nAnswer:" and ex[0].continuations == [" zzz", " xxx"]


def _check_task_dir(d, n):
    from megatron_lev.evaluation import load_lambada

    for task, (fname, _, _) in MC_TASKS.items():
        ex = load_mc_examples(task, os.path.join(d, fname), limit=n)
        assert len(ex) == n
        assert all(0 <= e.gold < len(e.continuations) == len(e.contexts) for e in ex)
        assert all(c and k for e in ex for c, k in zip(e.contexts, e.continuations))
    lam = load_lambada(os.path.join(d, "lambada_openai_test.jsonl"), limit=n)
    assert len(lam) == n and all(c.startswith(" ") and " " not in c[1:] for _, c in lam)


def test_task_files_parse(task_files):
    _check_task_dir(task_files.dir, task_files.examples)
    # golds spread over the choices, and both WinoGrande answers occur
    golds = [e.gold for e in load_mc_examples("hellaswag", task_files.files["hellaswag"])]
    assert len(set(golds)) == 4
    assert {e.gold for e in load_mc_examples("winogrande", task_files.files["winogrande"])} == {0, 1}


def test_real_task_files_parse(shared_data):
    _check_task_dir(str(shared_data / "downstream"), 20)


@pytest.mark.parametrize("task,row,msg", [
    ("piqa", '{"goal": "g", "sol1": "a", "label": 0}', "missing field 'sol2'"),
    ("piqa", '{"goal": "g", "sol1": "a", "sol2": "b", "label": 5}', "out of range"),
    ("hellaswag", '{"ctx_a": "a", "ctx_b": "b"', "not valid JSON"),
    ("arc_easy", '{"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "B"}', "answerKey 'B'"),
    ("winogrande", '{"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}', "no '_' blank"),
    ("lambada", '["text"]', "expected a JSON object"),
])
def test_malformed_task_files_name_file_and_line(tmp_path, byte_tokenizer, task, row, msg):
    from megatron_lev.evaluation.tasks import load_lambada

    good = {"piqa": {"goal": "g", "sol1": "a", "sol2": "b", "label": 0},
            "hellaswag": {"activity_label": "A", "ctx_a": "a", "ctx_b": "b", "endings": ["x", "y"], "label": "0"},
            "arc_easy": {"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "A"},
            "winogrande": {"sentence": "a _ b", "option1": "a", "option2": "b", "answer": "1"},
            "lambada": {"text": "a b c"}}[task]
    p = tmp_path / f"{task}.jsonl"
    p.write_text(json.dumps(good) + "\n\n" + row + "\n")
    with pytest.raises(DataFormatError) as e:
        load_lambada(str(p)) if task == "lambada" else load_mc_examples(task, str(p))
    assert f"{p}:3:" in str(e.value) and msg in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(DataFormatError, match="no such task file"):
        load_mc_examples("piqa", str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad_text.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(DataFormatError, match=f"{bad}:2: expected a JSON object with a string field 'text'"):
        list(jsonl_documents([str(bad)], byte_tokenizer))


def _result(label, ppl_all, bucket_ppl, acc):
    return {"meta": {"label": label, "model": label},
            "perplexity": {"valid": {"source": "v", "tokens": 100, "nll": math.log(ppl_all), "ppl": ppl_all,
                                     "bits_per_byte": 1.0, "seq_length": 8, "stride": 8,
                                     "frequency_buckets": [{"bucket": b, "tokens": 20, "nll": math.log(p), "ppl": p}
                                                           for b, p in zip(["< 1e-7", "1e-7 – 1e-6", "1e-6 – 1e-5",
                                                                            "1e-5 – 1e-4", "≥ 1e-4"], bucket_ppl)]}},
            "tasks": {"piqa": {"examples": 10, "acc": acc, "acc_stderr": 0.1, "acc_norm": acc}}}


def test_report_and_comparison(tmp_path):
    a, b, c = _result("tied", 100.0, [1000, 500, 200, 50, 10], 0.5), _result("lev", 90.0, [800, 450, 200, 55, 10], 0.6), \
        _result("untied", 110.0, [1100, 500, 200, 50, 10], 0.4)
    paths = []
    for r in (a, b, c):
        out = write_report(r, str(tmp_path / r["meta"]["label"]))
        assert set(out) >= {"json", "markdown", "freq_ppl", "tasks"}
        paths.append(out["json"])
    assert (tmp_path / "lev" / "freq_ppl.png").stat().st_size > 1000
    out = write_comparison(paths, str(tmp_path / "cmp"))
    cmp = json.loads(open(out["json"]).read())
    assert cmp["labels"] == ["tied", "lev", "untied"]
    # recorded relative to the comparison's folder: no machine paths in the report
    assert [os.path.normpath(os.path.join(tmp_path / "cmp", f)) for f in cmp["files"]] == paths
    assert cmp["files"][0] == os.path.join("..", "tied", "results.json")
    rows = cmp["perplexity"]["valid"]["buckets"]
    assert rows[0]["relative_change"][1] == pytest.approx(-0.2) and rows[3]["relative_change"][1] == pytest.approx(0.1)
    assert cmp["perplexity"]["valid"]["relative_change"][2] == pytest.approx(0.1)
    md = open(out["markdown"]).read()
    assert "-20.00%" in md and "+10.00%" in md and "+10.00 pt" in md
    assert (tmp_path / "cmp" / "compare_valid.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="at least two"):
        write_comparison(paths[:1], str(tmp_path / "cmp2"))



def _images(names):
    return "".join(f"![{n}.png]({n}.png)\n" for n in names)


def test_report_and_comparison_files_have_one_layout(tmp_path):
    """Both writers: {name}.json holds the data, {name}.md its tables followed by every PNG they plot."""
    from megatron_lev.evaluation.report import comparison_markdown, results_markdown

    runs = [_result("tied", 100.0, [1000, 500, 200, 50, 10], 0.5), _result("lev", 90.0, [800, 450, 200, 55, 10], 0.6)]
    outs = [write_report(r, str(tmp_path / r["meta"]["label"])) for r in runs]
    out = outs[0]
    assert sorted(out) == ["freq_ppl", "json", "markdown", "tasks"]
    assert out["json"] == str(tmp_path / "tied" / "results.json") and json.loads(open(out["json"]).read()) == runs[0]
    assert open(out["markdown"]).read() == results_markdown(runs[0]) + "\n" + _images(["freq_ppl", "tasks"])

    cmp = write_comparison([o["json"] for o in outs], str(tmp_path / "cmp"))
    assert sorted(cmp) == ["compare_valid", "json", "markdown"]
    saved = json.loads(open(cmp["json"]).read())
    assert cmp["json"] == str(tmp_path / "cmp" / "comparison.json") and saved["labels"] == ["tied", "lev"]
    assert open(cmp["markdown"]).read() == comparison_markdown(saved) + "\n" + _images(["compare_valid"])
    assert "| relative frequency | tokens | PPL tied | PPL lev | Δ lev |" in comparison_markdown(saved)
