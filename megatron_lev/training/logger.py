"""The run's output: Megatron-LM's log lines, TensorBoard and a JSON-lines metrics file from rank 0, wandb
(optional) from the last rank, as Megatron-LM logs it.

The training line keeps Megatron-LM's field names and order, so scripts that parse Megatron logs
(``iteration N/ M``, ``lm loss: X``, ``grad norm: X``...) keep working; this project's extra fields
(consumed tokens, tokens/s, TFLOP/s, MFU, memory) come after Megatron's. The scalars go to TensorBoard and
wandb under Megatron-LM's tags (``megatron/training/training.py``), so its dashboards work unchanged; where
this project's own tag differs, both are written.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

if TYPE_CHECKING:
    from megatron_lev.config.groups import LoggingConfig


def is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def is_last_rank() -> bool:
    return not torch.distributed.is_initialized() or \
        torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank0(*msg: Any) -> None:
    if is_rank0():
        print(*msg, flush=True)


def memory_string() -> str:
    if torch.cuda.is_available():
        alloc = torch.cuda.max_memory_allocated() / 2**30
        reserved = torch.cuda.max_memory_reserved() / 2**30
        return f"mem allocated (GiB): {alloc:.2f} | mem max reserved (GiB): {reserved:.2f}"
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        return f"max RSS (GiB): {rss:.2f}"
    except Exception:  # pragma: no cover
        return "max RSS (GiB): n/a"


def memory_scalars() -> Dict[str, float]:
    """--log-memory-to-tensorboard's scalars: the CUDA caching allocator's, as Megatron-LM writes them; on
    CPU the process's peak resident memory."""
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
                "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
                "mem-allocated-count": stats.get("allocation.all.current", 0)}
    import resource

    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # KiB on Linux


class LogWriterError(RuntimeError):
    """A writer (TensorBoard, wandb, the metrics file) cannot start; one line naming its flag."""


# This project's tags under Megatron-LM's names, written beside them.
MEGATRON_LM_TAGS = {"validation/lm loss": "lm loss validation", "validation/lm loss ppl": "lm loss validation ppl",
                    "throughput-tflops-per-device": "throughput"}
# The tags Megatron-LM also writes against the consumed samples, as "<tag> vs samples" (TensorBoard only;
# wandb gets "samples vs steps" instead).
VS_SAMPLES = frozenset({"lm loss", "learning-rate", "batch-size", "loss-scale", "world-size", "grad-norm",
                        "num-zeros", "params-norm", "lm loss validation", "lm loss validation ppl",
                        "validation/lm loss"})


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class TrainingLogger:
    """The run's writers, opened from its logging settings: TensorBoard and the metrics file on rank 0,
    wandb on the last rank (Megatron-LM's); ``save`` is --save, under which wandb writes (``wandb/``) when
    --wandb-save-dir is unset."""

    def __init__(self, config: "LoggingConfig", *, save: Optional[str] = None) -> None:
        self.rank0 = is_rank0()
        self.last_rank = is_last_rank()
        self.tb = None
        self.wandb = None
        self.metrics = None
        if not (self.rank0 or self.last_rank):
            return
        try:
            self._open_writers(config, save)
        except LogWriterError:
            self.close()  # the writers that did start
            raise

    def _open_writers(self, cfg: "LoggingConfig", save: Optional[str]) -> None:
        if self.rank0:
            self._open_rank0_writers(cfg)
        if cfg.wandb_project and self.last_rank:
            self._open_wandb(cfg, save)

    def _open_rank0_writers(self, cfg: "LoggingConfig") -> None:
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("WARNING: TensorBoard writing is not available (pip install tensorboard)", flush=True)
            except Exception as e:  # an install that fails as it imports (its protobuf too new or too old)
                raise LogWriterError(f"--tensorboard-dir {cfg.tensorboard_dir}: TensorBoard cannot be imported "
                                     f"({_first_line(e)}); repair its installation or drop the flag") from None
            else:
                try:
                    self.tb = SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)
                except Exception as e:
                    raise LogWriterError(f"--tensorboard-dir {cfg.tensorboard_dir}: TensorBoard's writer cannot "
                                         f"start ({_first_line(e)})") from None
        if cfg.metrics_file:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_file)), exist_ok=True)
                self.metrics = open(cfg.metrics_file, "a", encoding="utf-8")
            except OSError as e:
                raise LogWriterError(f"--metrics-file {cfg.metrics_file}: cannot be opened "
                                     f"({e.strerror or e}); choose a writable path") from None

    def _open_wandb(self, cfg: "LoggingConfig", save: Optional[str]) -> None:
        """As Megatron-LM: the run under --wandb-save-dir (default: --save's wandb/), named --wandb-exp-name,
        in --wandb-entity's account when given; WANDB_MODE=offline keeps it on the disk."""
        flag = f"--wandb-project {cfg.wandb_project}"
        try:
            import wandb  # optional dependency
        except ImportError:
            raise LogWriterError(f"{flag}: the wandb package is not installed; pip install wandb, or drop the "
                                 "--wandb-* flags") from None
        except Exception as e:
            raise LogWriterError(f"{flag}: wandb cannot be imported ({_first_line(e)}); repair its installation "
                                 "or drop the flag") from None
        save_dir = cfg.wandb_save_dir or (os.path.join(save, "wandb") if save else None)
        kwargs = {"project": cfg.wandb_project, "name": cfg.wandb_exp_name, "dir": save_dir, "config": None}
        if cfg.wandb_entity:
            kwargs["entity"] = cfg.wandb_entity
        if save_dir:
            try:
                os.makedirs(save_dir, exist_ok=True)
            except OSError as e:
                raise LogWriterError(f"{'--wandb-save-dir' if cfg.wandb_save_dir else '--save'} {save_dir}: cannot be "
                                     f"created for wandb ({e.strerror or e}); choose a writable path") from None
        try:
            self.wandb = wandb.init(**kwargs)
        except Exception as e:  # no login (no API key on the node), no network
            raise LogWriterError(f"{flag}: wandb cannot start ({_first_line(e)}); log in with `wandb login`, "
                                 "or set WANDB_MODE=offline") from None

    def set_config(self, cfg: Dict[str, Any]) -> None:
        if self.wandb is not None:
            self.wandb.config.update(cfg, allow_val_change=True)
        if self.tb is not None:
            self.tb.add_text("config", "\n".join(f"    {k}: {v}" for k, v in cfg.items()), 0)

    def log(self, msg: str) -> None:
        if self.rank0:
            print(msg, flush=True)

    def record(self, kind: str, iteration: int, values: Dict[str, Any]) -> None:
        """Exact values to the metrics file (one JSON object per line)."""
        if self.metrics is not None:
            row = {"kind": kind, "iteration": iteration}
            row.update(values)
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()

    def scalars(self, iteration: int, values: Dict[str, float], consumed_samples: Optional[int] = None) -> None:
        """``values`` at ``iteration`` (None: not written), each also under Megatron-LM's tag where this
        project's differs; with ``consumed_samples``, Megatron-LM's "vs samples" tags on TensorBoard and
        its "samples vs steps" on wandb."""
        tagged = {}
        for k, v in values.items():
            if v is not None:
                tagged[k] = v
                if k in MEGATRON_LM_TAGS:
                    tagged[MEGATRON_LM_TAGS[k]] = v
        if self.tb is not None:
            for k, v in tagged.items():
                self.tb.add_scalar(k, v, iteration)
                if consumed_samples is not None and k in VS_SAMPLES:
                    self.tb.add_scalar(f"{k} vs samples", v, consumed_samples)
            self.tb.flush()
        if self.wandb is not None:
            if consumed_samples is not None:
                tagged["samples vs steps"] = consumed_samples
            self.wandb.log(tagged, step=iteration)

    def training_line(self, *, iteration: int, train_iters: int, consumed_samples: int, consumed_tokens: int,
                      ms_per_iter: float, lr: float, global_batch_size: int, losses: Dict[str, float],
                      loss_scale: float, grad_norm: Optional[float], skipped: int, nan: int,
                      tokens_per_s: float, tflops_per_device: float, mfu: Optional[float],
                      num_zeros: Optional[float] = None, params_norm: Optional[float] = None) -> str:
        s = f" [{time.strftime('%Y-%m-%d %H:%M:%S')}]"
        s += f" iteration {iteration:8d}/{train_iters:8d} |"
        s += f" consumed samples: {consumed_samples:12d} |"
        s += f" elapsed time per iteration (ms): {ms_per_iter:.1f} |"
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops_per_device:.3f} |"
        s += f" learning rate: {lr:.6E} |"
        s += f" global batch size: {global_batch_size:5d} |"
        for k, v in losses.items():
            s += f" {k}: {v:.6E} |"
        s += f" loss scale: {loss_scale:.1f} |"
        if grad_norm is not None:
            s += f" grad norm: {grad_norm:.3f} |"
        if num_zeros is not None:  # --log-num-zeros-in-grad
            s += f" num zeros: {num_zeros:.1f} |"
        if params_norm is not None:  # --log-params-norm
            s += f" params norm: {params_norm:.3f} |"
        s += f" number of skipped iterations: {skipped:3d} |"
        s += f" number of nan iterations: {nan:3d} |"
        s += f" consumed tokens: {consumed_tokens} |"
        s += f" tokens per second: {tokens_per_s:.1f} |"
        s += f" MFU: {mfu * 100:.2f}% |" if mfu is not None else " MFU: n/a |"
        s += f" {memory_string()} |"
        return s

    def validation_block(self, prefix: str, losses: Dict[str, float]) -> str:
        s = f" validation loss at {prefix} | "
        for k, v in losses.items():
            ppl = math.exp(min(20.0, v)) if math.isfinite(v) else float("nan")
            s += f"{k} value: {v:.6E} | {k} PPL: {ppl:.6E} | "
        bar = "-" * (len(s) + 1)
        return f"{bar}\n{s}\n{bar}"

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.metrics is not None:
            self.metrics.close()
        sys.stdout.flush()
