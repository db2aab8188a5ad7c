"""One-process ``pretrain`` runs that count what the run-hygiene flags do (``gc.disable``/``gc.collect``
called by the loop, ``torch.cuda.empty_cache``, the root logger's level during the steps).

    python tests/training/_counted_run.py RESULT.json 'argv one' 'argv two' ...

Each argument is one run's argv (space-separated); RESULT.json gets one object per run:
{"code", "gc_disable", "gc_collect", "gc_collect_gen0", "empty_cache", "root_level", "level_after"}.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_lev.training import loop, pretrain, profiling  # noqa: E402


class _CountingGC:
    def __init__(self, real, counts):
        self.real, self.counts = real, counts

    def disable(self):
        self.counts["gc_disable"] += 1
        self.real.disable()

    def enable(self):
        self.real.enable()

    def isenabled(self):
        return self.real.isenabled()

    def collect(self, generation=2):
        self.counts["gc_collect_gen0" if generation == 0 else "gc_collect"] += 1
        return self.real.collect(generation)


def main(result: str, runs) -> int:
    out = []
    real_gc, real_empty, real_step = profiling.gc, torch.cuda.empty_cache, loop._train_step
    for argv in runs:
        counts = {"gc_disable": 0, "gc_collect": 0, "gc_collect_gen0": 0, "empty_cache": 0, "root_level": None}

        def empty_cache():
            counts["empty_cache"] += 1
            real_empty()

        def step(*a, **kw):
            counts["root_level"] = logging.getLogger().level
            return real_step(*a, **kw)

        profiling.gc, torch.cuda.empty_cache, loop._train_step = _CountingGC(real_gc, counts), empty_cache, step
        try:
            counts["code"] = pretrain(argv.split())
        finally:
            profiling.gc, torch.cuda.empty_cache, loop._train_step = real_gc, real_empty, real_step
        counts["level_after"] = logging.getLogger().level
        out.append(counts)
    Path(result).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
