"""Scorers: token sequences in, per-token log-probabilities of the targets out.

Every evaluation in this package is written against :class:`Scorer`. A scorer receives token
sequences ``t[0..n-1]`` and returns, for each, ``log p(t[i] | t[:i])`` for ``i = 1..n-1`` plus
whether ``t[i]`` is the model's argmax at that position (for greedy-match metrics such as LAMBADA
accuracy). Implementations:

- :class:`~megatron_lev.evaluation.megatron_scorer.MegatronScorer`: a megatron-lev checkpoint at any
  TP/PP (forward over the pipeline with megatron-core's schedules, results broadcast to all ranks).
- :class:`~megatron_lev.evaluation.hf_scorer.HFScorer`: a Hugging Face causal-LM directory.
- :class:`LogitsScorer`: any callable ``tokens [B, L] -> logits [B, L, V]`` (tests, custom models).

Batching: sequences are sorted by length (longest first, as lm-evaluation-harness does) and
right-padded; causal attention makes the padding invisible to the real tokens. Results come back
in the input order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_lev.progress import Progress

PROGRESS_SECONDS = 10.0
"""Seconds between the progress lines of an evaluation whose standard error is not a terminal."""


@dataclass
class TokenScores:
    """Scores of one sequence of n tokens: arrays of length n - 1 (targets t[1:])."""

    logprobs: np.ndarray  # float64, log p(t[i] | t[:i])
    greedy: np.ndarray  # bool, t[i] == argmax of the model's distribution at i


class Scorer:
    """Base class: subclasses implement :meth:`_score_padded` (and set ``max_length``).

    Attributes:
        max_length: longest input the model takes; a sequence may have ``max_length + 1`` tokens
            (the last one is only a target).
        vocab_size: size of the model's output distribution (padded vocabulary for Megatron).
        batch_size: sequences per forward call.
        is_main: whether this process writes output (rank 0 under torch.distributed).
    """

    max_length: int = 2048
    vocab_size: int = 0
    batch_size: int = 8
    is_main: bool = True
    description: str = "scorer"

    def score(self, sequences: Sequence[Sequence[int]], progress: Optional[Progress] = None) -> List[TokenScores]:
        """Per-token log-probs and greedy flags of each sequence (input order); ``progress`` counts the
        sequences scored.

        Each sequence needs at least 2 and at most ``max_length + 1`` tokens.
        """
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        for i, s in enumerate(seqs):
            if len(s) < 2:
                raise ValueError(f"sequence {i} has {len(s)} token(s); at least 2 are needed")
            if len(s) > self.max_length + 1:
                raise ValueError(f"sequence {i} has {len(s)} tokens; at most max_length + 1 = "
                                 f"{self.max_length + 1} fit")
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        out: List[Optional[TokenScores]] = [None] * len(seqs)
        for idx, res in zip(batches, self._score_batches([[seqs[i] for i in b] for b in batches], progress)):
            for i, r in zip(idx, res):
                out[i] = r
        return out  # type: ignore[return-value]

    # -- for subclasses
    def _score_batches(self, batches: List[List[np.ndarray]], progress: Optional[Progress]) -> Iterable[List[TokenScores]]:
        for batch in batches:
            yield self._score_batch(batch)
            if progress is not None:
                progress.update(len(batch))

    def _score_batch(self, batch: List[np.ndarray]) -> List[TokenScores]:
        tokens, lengths = pad_batch(batch)
        logprobs, greedy = self._score_padded(tokens)
        return [TokenScores(logprobs[i, : n - 1].astype(np.float64), greedy[i, : n - 1].astype(bool))
                for i, n in enumerate(lengths)]

    def _score_padded(self, tokens: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
        """tokens [B, L] (right-padded) -> (logprobs [B, L-1], greedy [B, L-1]) for targets tokens[:, 1:]."""
        raise NotImplementedError


def pad_batch(batch: Sequence[np.ndarray], pad_id: int = 0) -> Tuple[torch.Tensor, List[int]]:
    lengths = [len(s) for s in batch]
    out = torch.full((len(batch), max(lengths)), pad_id, dtype=torch.long)
    for i, s in enumerate(batch):
        out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out, lengths


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary logits [B, S, V] and targets [B, S] -> (log p(target) [B, S], target is argmax)."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    greedy = logits.argmax(dim=-1) == targets
    return lp, greedy


class LogitsScorer(Scorer):
    """A scorer over any callable ``tokens [B, L] (long) -> logits [B, L, V]``."""

    def __init__(self, logits_fn: Callable[[torch.Tensor], torch.Tensor], *, max_length: int, vocab_size: int,
                 batch_size: int = 8, description: str = "logits function") -> None:
        self.logits_fn = logits_fn
        self.max_length = int(max_length)
        self.vocab_size = int(vocab_size)
        self.batch_size = int(batch_size)
        self.description = description

    @torch.no_grad()
    def _score_padded(self, tokens: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
        logits = self.logits_fn(tokens[:, :-1])
        lp, greedy = logprobs_from_logits(logits, tokens[:, 1:])
        return lp.double().cpu().numpy(), greedy.cpu().numpy()


def scoring_progress(scorer: Scorer, desc: str, *, total: Optional[int] = None, unit: str = "request",
                     enabled: bool = True, seconds: float = PROGRESS_SECONDS) -> Progress:
    """The progress of an evaluation's scoring, shown by the main process: a bar on a terminal, else a line
    every ``seconds`` (0: every batch)."""
    return Progress(desc, total=total, unit=unit, seconds=seconds, leave=False, enabled=enabled and scorer.is_main)
