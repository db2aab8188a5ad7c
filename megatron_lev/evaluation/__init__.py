"""Evaluation: perplexity (indexed or raw jsonl data, sliding windows, bits per byte), perplexity by
training-token frequency and comparisons, zero-shot perplexity, LAMBADA, multiple choice
(HellaSwag, PIQA, WinoGrande, ARC) scored like lm-evaluation-harness; result files and plots.

Everything runs on a :class:`Scorer` (token sequences -> per-token log-probs): ``MegatronScorer``
(a checkpoint at any TP/PP), ``HFScorer`` (a Hugging Face directory) or ``LogitsScorer`` (any
function). Heavy modules (megatron-core, transformers, matplotlib) load only when used.
"""

from .perplexity import (
    EXPOSURE_BUCKETS,
    PAPER_EDGES,
    DataFormatError,
    PerplexityResult,
    documents_from_path,
    evaluate_perplexity,
    indexed_documents,
    iter_windows,
    jsonl_documents,
    load_token_counts,
    parse_edges,
    spread_indices,
    stratify,
    stratify_by_exposure,
)
from .report import compare_results, load_results, write_comparison, write_report
from .scorer import LogitsScorer, Scorer, TokenScores
from .tasks import (
    ALL_TASKS,
    MC_TASKS,
    encode_pair,
    evaluate_lambada,
    evaluate_multiple_choice,
    load_lambada,
    load_mc_examples,
    loglikelihood,
)

__all__ = [
    "PAPER_EDGES", "DataFormatError", "PerplexityResult", "documents_from_path", "evaluate_perplexity",
    "indexed_documents", "iter_windows", "jsonl_documents", "load_token_counts", "parse_edges", "stratify",
    "EXPOSURE_BUCKETS", "spread_indices", "stratify_by_exposure",
    "compare_results", "load_results", "write_comparison", "write_report", "LogitsScorer", "Scorer", "TokenScores",
    "ALL_TASKS", "MC_TASKS", "encode_pair", "evaluate_lambada", "evaluate_multiple_choice", "load_lambada",
    "load_mc_examples", "loglikelihood",
]
