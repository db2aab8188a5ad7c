"""Start-up cost of a process: what a rank, a tool or ``--help`` pays before its first line of work.

Each sample is a fresh interpreter importing what ``pretrain_lev.py`` imports (``megatron_lev.training``),
timed by the child itself (wall from its first line, CPU from ``getrusage``). Two arms, interleaved:
``deferred`` (megatron_lev first: megatron-core's import-time ``torch.compile`` decorations deferred,
``compat/startup.py``) and ``eager`` (``megatron.core`` imported before megatron_lev, as without the hook).

    python bench/startup.py [--samples 7]

Prints the medians of each arm and the ratios, with the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, resource, sys, time
t = time.perf_counter()
if {eager}:
    import megatron.core
import megatron_lev.training
r = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"wall": time.perf_counter() - t, "cpu": r.ru_utime + r.ru_stime,
                  "dynamo": "torch._dynamo" in sys.modules}}))
"""


def sample(eager: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(eager=eager)], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(samples: int) -> dict:
    arms = {"deferred": [], "eager": []}
    for _ in range(samples):
        for arm in arms:  # interleaved: a load change hits both arms alike
            arms[arm].append(sample(arm == "eager"))
    return {arm: {"wall_s": statistics.median(s["wall"] for s in runs),
                  "cpu_s": statistics.median(s["cpu"] for s in runs),
                  "dynamo_imported": any(s["dynamo"] for s in runs)} for arm, runs in arms.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=7, help="fresh processes per arm (medians)")
    a = p.parse_args(argv)
    if a.samples < 1:
        p.error("--samples must be at least 1")
    load = os.getloadavg()[0]
    res = measure(a.samples)
    res["load_before"], res["load_after"] = load, os.getloadavg()[0]
    print(f"python {sys.version.split()[0]}, {a.samples} samples per arm, load average {load:.1f} -> "
          f"{res['load_after']:.1f}")
    for arm in ("eager", "deferred"):
        r = res[arm]
        print(f"{arm:>8}: median wall {r['wall_s']:.2f} s, CPU {r['cpu_s']:.2f} s, "
              f"TorchDynamo imported: {r['dynamo_imported']}")
    print(f"start-up CPU ratio (deferred / eager): {res['deferred']['cpu_s'] / res['eager']['cpu_s']:.2f}")
    print(f"start-up wall ratio (deferred / eager): {res['deferred']['wall_s'] / res['eager']['wall_s']:.2f}")
    return res


if __name__ == "__main__":
    main()
