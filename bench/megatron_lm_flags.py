"""How many flags of a Megatron-LM launch script pretrain_lev.py's parser accepts, refuses by name, or
does not know.

    python bench/megatron_lm_flags.py SCRIPT.sh [SCRIPT.sh ...]

A flag is every ``--name`` in the script (each counted once). "accepted": pretrain_lev.py has the flag;
"refused": megatron_lm.py refuses it in one line naming the feature; "unknown": neither. Prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lev.arguments import build_parser  # noqa: E402
from megatron_lev.arguments.megatron_lm import refusal  # noqa: E402

# Launcher flags of torchrun, not of the training script.
_LAUNCHER = {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"}


def script_flags(text: str):
    """The ``--flag`` names of a shell script, in order of first appearance (comments dropped)."""
    seen = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for flag in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", line):
            if flag not in seen and flag not in _LAUNCHER:
                seen.append(flag)
    return seen


def tally(flags):
    known = set(build_parser()._option_string_actions)
    accepted = [f for f in flags if f in known]
    refused = [f for f in flags if f not in known and refusal(f)]
    unknown = [f for f in flags if f not in known and not refusal(f)]
    return accepted, refused, unknown


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scripts", nargs="+")
    args = p.parse_args(argv)
    print("| script | Megatron flags | accepted | refused in one line | unknown |")
    print("|---|---|---|---|---|")
    for path in args.scripts:
        flags = script_flags(Path(path).read_text(encoding="utf-8"))
        accepted, refused, unknown = tally(flags)
        print(f"| `{Path(path).name}` | {len(flags)} | {len(accepted)} | {' '.join(refused) or '-'} | "
              f"{' '.join(unknown) or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
