"""How many flags of a Megatron-LM launch script pretrain_lev.py's parser accepts, refuses by name, or
does not know.

    python bench/megatron_lm_flags.py SCRIPT.sh [SCRIPT.sh ...]

A flag is every ``--name`` in the script (each counted once). "accepted": pretrain_lev.py has the flag;
"refused in one line": megatron_lm.py refuses it naming the feature; "refused as unknown": neither.
Prints a Markdown table; then, with ``--stops``, where each script stops: the script is run by bash with
``torchrun`` replaced by a function that prints its arguments (in a scratch directory holding an empty
``pretrain_gpt.py``; its positional arguments ``--script-args``, default none), the argv it passes is parsed
with ``--input-embedding lev`` added at the world size its TP x PP x CP needs, and each one-line
error is listed, the flag it names dropped and the parse repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lev.arguments import build_parser, parse_args  # noqa: E402
from megatron_lev.arguments.megatron_lm import refusal  # noqa: E402
from megatron_lev.lev.config import ConfigError  # noqa: E402

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


_PRINT_ARGS = 'torchrun() { python3 -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"; }; export -f torchrun'


def expanded_argv(path: str, script_args=()):
    """The words the script (run with ``script_args``) passes to its training entry point (after the
    ``*.py`` argument), as bash expands them."""
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "pretrain_gpt.py").touch()
        r = subprocess.run(["bash", "-c", f'{_PRINT_ARGS}; source "$0"', os.path.abspath(path), *script_args],
                           cwd=scratch,
                           capture_output=True, text=True, timeout=60)
    words = json.loads(r.stdout.strip().splitlines()[-1])
    return words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1:]


def _value(argv, flag: str, default: int = 1) -> int:
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


def stops(argv):
    """Each one-line error of the parser on ``argv`` (+ ``--input-embedding lev``), dropping the flag it
    names and parsing again, until it parses or an error names no flag of ``argv``."""
    argv, out = list(argv) + ["--input-embedding", "lev"], []
    world = (_value(argv, "--tensor-model-parallel-size") * _value(argv, "--pipeline-model-parallel-size")
             * _value(argv, "--context-parallel-size"))
    while True:
        try:
            parse_args(argv, world_size=world)
            return out
        except ConfigError as e:
            msg = str(e)
            out.append(msg)
        m = re.match(r"(?:unrecognized arguments: |argument )?(--[\w-]+)", msg)
        bad = m.group(1) if m else None
        if msg.startswith("unrecognized arguments: ") and bad not in argv:  # words of a split value
            bad = next(argv[i] for i in range(argv.index(msg.split()[2]), -1, -1) if argv[i].startswith("--"))
        if bad not in argv:
            return out
        i = argv.index(bad)
        j = next((k for k in range(i + 1, len(argv)) if argv[k].startswith("--")), len(argv))
        del argv[i:j]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scripts", nargs="+")
    p.add_argument("--stops", action="store_true", help="also run each script (bash) and list where parsing stops")
    p.add_argument("--script-args", nargs="*", default=[], help="with --stops: the scripts' positional arguments")
    args = p.parse_args(argv)
    print("| script | Megatron flags | accepted | refused in one line | refused as unknown |")
    print("|---|---|---|---|---|")
    for path in args.scripts:
        flags = script_flags(Path(path).read_text(encoding="utf-8"))
        accepted, refused, unknown = tally(flags)
        print(f"| `{Path(path).name}` | {len(flags)} | {len(accepted)} | {' '.join(refused) or '-'} | "
              f"{' '.join(unknown) or '-'} |")
    if args.stops:
        for path in args.scripts:
            print(f"\n`{Path(path).name}` stops on:")
            for msg in stops(expanded_argv(path, args.script_args)) or ["nothing: it parses"]:
                print(f"- {msg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
