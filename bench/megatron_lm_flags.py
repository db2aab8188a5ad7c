"""How many flags of a Megatron-LM launch script pretrain_lev.py's parser accepts, refuses by name, or
does not know.

    python bench/megatron_lm_flags.py SCRIPT.sh [SCRIPT.sh ...]

A flag is every ``--name`` in the script (each counted once). "accepted": pretrain_lev.py has the flag;
"refused in one line": megatron_lm.py refuses it naming the feature; "refused as unknown": neither.
The options of the commands that wrap a launch (``nsys profile``, ``srun``, ``salloc``, ``sbatch``,
``mpirun``; a command continued over lines with ``\`` read as one line) and words that are no flag names
(``--M-M-M-M``, a layer pattern's value: a flag name has a lower-case letter) are not counted; ``#SBATCH``
lines are comments. Prints a Markdown table; then, with ``--stops``, where each script stops: the
script is run by bash with its launcher replaced by a function that prints its arguments (``torchrun``,
``python -m torch.distributed.run|launch``, either behind ``uv run``, and ``srun`` in sbatch scripts; in a
scratch directory holding an empty ``pretrain_gpt.py``; its arguments ``--script-args "A B --flag V"``,
one shell-quoted string, default none; ``sbatch`` runs the script it is given, its ``--wrap`` command or
the script on its standard input, a here-document, with the same replacements; ``sh -c`` runs in bash), the argv it passes is parsed with ``--input-embedding lev`` added at the launch's world
size (``--nproc-per-node`` x ``--nnodes``; for ``srun`` or no launcher option, TP x PP x CP), and each
one-line error is listed, the flag it names dropped and the parse repeated. ``--env NAME=VALUE`` sets the
script's environment (``SLURM_NNODES=4`` for a four-node launch); ``--assume-cuda-te`` parses as on a machine
with CUDA GPUs and Transformer Engine, so that only the stops of this fork remain (without it, the stops a
CPU machine adds name CUDA or Transformer Engine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lev.arguments import build_parser, parse_args  # noqa: E402
from megatron_lev.arguments.megatron_lm import refusal  # noqa: E402
from megatron_lev.lev.config import ConfigError  # noqa: E402

# Launcher flags of torchrun (either spelling, _ or -), not of the training script.
_LAUNCHER = {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-id",
             "--rdzv-backend", "--rdzv-endpoint"}


# The options of a command that wraps the launch (a profiler, a Slurm or MPI launcher), up to the command
# it runs: a launcher, an interpreter, a script, a shell, or another wrapper.
_WRAPPER = re.compile(r"\b(?:nsys\s+profile|srun|salloc|sbatch|mpirun)\b.*?"
                      r"(?=\btorchrun\b|\bpython3?\b|\S+\.(?:py|sh)\b|\b(?:ba)?sh\b|\bnsys\b|\buv\b|$)")
# What a script prints (its usage text), up to the end of that command.
_ECHO = re.compile(r"\b(?:echo|printf)\b[^;|&]*")
# A flag name: letters, digits, - and _ with at least one lower-case letter (Megatron-LM's spelling, and its
# older --DDP-impl); a word such as --M-M-M* or --M-M-M-M is a layer pattern's value, and a word before ")" or
# "|" a pattern of the script's own option parsing (case "$1" in --checkpoint-path) ...).
_FLAG = re.compile(r"(?<![\w-])--(?=[A-Za-z0-9_-]*[a-z])[A-Za-z][A-Za-z0-9_-]*(?![\w*+|)-])")


def script_flags(text: str):
    """The ``--flag`` names of a shell script, in order of first appearance (comments and the wrapping
    commands' options dropped)."""
    seen = []
    text = "\n".join(re.sub(r"(^|\s)#.*", r"\1", line) for line in text.splitlines())  # a comment starts a word
    text = re.sub(r"\\\n", " ", text)  # continued lines
    text = re.sub(r"=\(([^()]*)\)", lambda m: "=(" + m.group(1).replace("\n", " ") + ")", text)  # NAME=( ... )
    for line in text.splitlines():
        line = _ECHO.sub(" ", _WRAPPER.sub(" ", line))
        for flag in _FLAG.findall(line):
            if flag not in seen and flag.replace("_", "-") not in _LAUNCHER:
                seen.append(flag)
    return seen


def tally(flags):
    known = set(build_parser()._option_string_actions)
    accepted = [f for f in flags if f in known]
    refused = [f for f in flags if f not in known and refusal(f)]
    unknown = [f for f in flags if f not in known and not refusal(f)]
    return accepted, refused, unknown


# Launchers replaced by functions: torchrun prints its arguments as JSON; `python -m torch.distributed.run`
# and `uv run ...` go to it; srun drops its own options and runs the rest (python pretrain_gpt.py prints).
_SHIMS = r"""
__print() {{ {py} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@"; }}
torchrun() {{ __print "$@"; }}
python() {{ while [[ "$1" == -[uOBsSEI]* ]]; do shift; done
  case "$1 $2" in "-m torch.distributed.run"|"-m torch.distributed.launch") shift 2; __print "$@";;
  *) if [[ "$1" == *.py ]]; then __print "$@"; else command python "$@"; fi;; esac; }}
python3() {{ python "$@"; }}
uv() {{ if [ "$1" = run ]; then shift; while [[ "$1" == -* ]]; do shift; done; "$@"; else command uv "$@"; fi; }}
# A long option without "=" takes the next word unless that word is the command (srun --exclusive python ...).
__cmd() {{ case "$1" in python*|torchrun|bash|sh|uv|nsys|*.py|*.sh) return 0;; *) return 1;; esac; }}
srun() {{ while [[ "$1" == -* ]]; do case "$1" in -[NnctpAJoe]) shift 2;; --*=*) shift;;
  --*) if __cmd "$2"; then shift; else shift 2; fi;; *) shift;; esac; done; "$@"; }}
sbatch() {{ local wrap=; while [[ "$1" == -* ]]; do case "$1" in --wrap=*) wrap=${{1#--wrap=}}; shift;;
  --wrap) wrap=$2; shift 2;; -[NnctpAJoedw]) shift 2;; *) shift;; esac; done
  if [ -n "$wrap" ]; then bash -c "$wrap"; elif [ $# -gt 0 ]; then bash "$@"; else bash -s; fi; }}
sh() {{ bash "$@"; }}
export -f __print __cmd torchrun python python3 uv srun sbatch sh
"""


def launch(path: str, script_args=(), env=None):
    """(launcher words, training words): what the script (run with ``script_args``, its environment
    updated with ``env``, from a copy of its folder) passes to its launcher before the ``*.py`` entry point,
    and to the entry point after it, as bash expands them. A script whose launch is none of the replaced ones raises ValueError
    naming it."""
    with tempfile.TemporaryDirectory() as scratch:
        # A copy of the script's folder, so that what it sources or starts beside itself is found.
        shutil.copytree(os.path.dirname(os.path.abspath(path)), scratch, dirs_exist_ok=True)
        Path(scratch, "pretrain_gpt.py").touch()
        shims = _SHIMS.format(py=sys.executable)
        r = subprocess.run(["bash", "-c", f'{shims}\nsource "$0"', os.path.join(scratch, os.path.basename(path)),
                            *script_args],
                           cwd=scratch, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    for line in reversed(r.stdout.strip().splitlines()):
        try:
            words = json.loads(line)
        except ValueError:
            continue
        if isinstance(words, list) and any(str(w).endswith(".py") for w in words):
            i = next(i for i, w in enumerate(words) if w.endswith(".py"))
            return words[:i], words[i + 1:]
    raise ValueError(f"{path}: no training command was launched (torchrun, python -m torch.distributed.run, "
                     f"uv run, srun or python *.py); exit {r.returncode}: "
                     f"{(r.stderr.strip().splitlines() or [''])[-1]}")


def expanded_argv(path: str, script_args=()):
    """The words the script passes to its training entry point (see :func:`launch`)."""
    return launch(path, script_args)[1]


def launcher_world_size(words) -> Optional[int]:
    """``--nproc-per-node`` x ``--nnodes`` of torchrun's words (``=`` or separate values, either
    spelling); None where the launch names no process count."""
    def get(name):
        for i, w in enumerate(words):
            key, _, val = w.partition("=")
            if key.replace("_", "-") == name:
                val = val or (words[i + 1] if i + 1 < len(words) else "")
                return int(val.split(":")[-1]) if val.split(":")[-1].isdigit() else None
        return None
    nproc = get("--nproc-per-node")
    return None if nproc is None else nproc * (get("--nnodes") or 1)


def _value(argv, flag: str, default: int = 1) -> int:
    return int(argv[argv.index(flag) + 1]) if flag in argv else default


@contextlib.contextmanager
def assumed_cuda_and_te():
    """What the parser asks of the machine answered as on a node of H100s with Transformer Engine: CUDA
    available (compute capability 9.0), megatron-core's Transformer Engine flags set."""
    from unittest import mock

    import torch

    from megatron_lev.models import config as model_config

    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "device_count", lambda: 8), \
            mock.patch.object(model_config, "te_available", lambda: True), \
            mock.patch.object(model_config, "cuda_capability", lambda: (9, 0)):
        yield


def stops(argv, world_size=None, assume_cuda_te: bool = False):
    """Each one-line error of the parser on ``argv`` (+ ``--input-embedding lev``) at ``world_size``
    ranks (default: TP x PP x CP), dropping the flag it names and parsing again, until it parses or an
    error names no flag of ``argv``; ``assume_cuda_te``: parsed as with CUDA and Transformer Engine."""
    argv, out = list(argv) + ["--input-embedding", "lev"], []
    world = world_size or (_value(argv, "--tensor-model-parallel-size")
                           * _value(argv, "--pipeline-model-parallel-size") * _value(argv, "--context-parallel-size"))
    while True:
        try:
            with assumed_cuda_and_te() if assume_cuda_te else contextlib.nullcontext():
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("scripts", nargs="+")
    p.add_argument("--stops", action="store_true", help="also run each script (bash) and list where parsing stops")
    p.add_argument("--script-args", default="", metavar="'A B --flag V'",
                   help="with --stops: the scripts' arguments, one shell-quoted string (flags and values included)")
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="with --stops: the scripts' environment (e.g. SLURM_NNODES=4)")
    p.add_argument("--assume-cuda-te", action="store_true",
                   help="with --stops: parse as on a machine with CUDA GPUs and Transformer Engine")
    args = p.parse_args(argv)
    bad = [e for e in args.env if "=" not in e or not e.split("=", 1)[0]]
    if bad:
        p.error(f"--env {bad[0]}: expected NAME=VALUE")
    env = dict(e.split("=", 1) for e in args.env)
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
            try:
                launcher, argv = launch(path, shlex.split(args.script_args), env)
            except ValueError as e:
                print(f"- cannot tell: {e}")
                continue
            for msg in stops(argv, launcher_world_size(launcher), args.assume_cuda_te) or ["nothing: it parses"]:
                print(f"- {msg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
