"""A Hugging Face causal-LM directory (e.g. an export of a megatron-lev checkpoint) as a Scorer.

The same evaluations then run on the export, and numbers can be checked against
lm-evaluation-harness's ``hf`` model on that directory. The tokenizer comes from the directory
(``AutoTokenizer``) unless one is passed; ``HFTokenizerAdapter`` gives it the small interface the
tasks use (``tokenize``, ``detokenize``, ``eod``). No special tokens are added (as lm-eval's HF model
does for GPT-2-style tokenizers).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from .scorer import Scorer, logprobs_from_logits


class HFTokenizerAdapter:
    """``transformers`` tokenizer -> the ``tokenize/detokenize/eod`` interface of megatron-lev tokenizers."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    @property
    def eod(self) -> int:
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            v = getattr(self.tok, name, None)
            if v is not None:
                return int(v)
        raise ValueError("the tokenizer has no eos/bos/pad token to separate documents")

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def tokenize(self, text: str) -> List[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids) -> str:
        return self.tok.decode(list(ids))


class HFScorer(Scorer):
    """Scores with ``AutoModelForCausalLM.from_pretrained(path)``."""

    def __init__(self, path: str, *, batch_size: int = 8, device: Optional[str] = None, dtype: Optional[str] = None,
                 max_length: Optional[int] = None) -> None:
        from transformers import AutoModelForCausalLM

        self.path = path
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        kw = {}
        if dtype:
            kw["dtype"] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(path, **kw).to(self.device).eval()
        cfg = self.model.config
        limit = None
        for name in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
            limit = limit or getattr(cfg, name, None)
        self.max_length = int(min(max_length, limit) if (max_length and limit) else (max_length or limit or 2048))
        self.vocab_size = int(cfg.vocab_size)
        self.batch_size = int(batch_size)
        self.description = f"hf {path}"

    def tokenizer(self) -> HFTokenizerAdapter:
        from transformers import AutoTokenizer

        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(self.path))

    @torch.no_grad()
    def _score_padded(self, tokens: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
        inp = tokens[:, :-1].to(self.device)
        logits = self.model(input_ids=inp).logits
        lp, greedy = logprobs_from_logits(logits, tokens[:, 1:].to(self.device))
        return lp.double().cpu().numpy(), greedy.cpu().numpy()
