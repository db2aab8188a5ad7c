"""A full disk under every writer but training's checkpoints (tests/reliability/test_training_faults.py):
the conversions (export-hf, export-lev, reshard, to-lev) and preprocessing, run as a user runs them.

The disk is "full" under one folder only: a ``sitecustomize`` on the tools' PYTHONPATH (loaded by every
process, the conversion ranks too) makes each write below ``$FULL_UNDER`` put a few bytes and fail
with ENOSPC, through Python's ``open`` (dist_checkpointing, torch.save, json, yaml) and safetensors.
Each is one line naming ``--save`` (or ``--output-prefix``) and the free space, exits non-zero, leaves
no partial output behind, and the same command succeeds once there is room.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lev.testing.cli import run_cli
from tests.reliability.test_training_faults import tiny_args
from tests.training.test_pretrain import REPO, _env, run_single

# Its tests share multi-process jobs (~82 s for the module on 2 cores): not in make test-fast.
pytestmark = pytest.mark.slow

INJECT = '''
import builtins, errno, os

_under = os.environ.get("FULL_UNDER")


def _full(path):
    try:
        return bool(_under) and os.path.abspath(os.fspath(path)).startswith(_under + os.sep)
    except TypeError:
        return False


def _no_space(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


class _FullFile:
    def __init__(self, f, path):
        self._f, self._path = f, path

    def write(self, data):
        self._f.write(data[:16])
        self._f.flush()
        raise _no_space(self._path)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


if _under:
    _open = builtins.open

    def _open_full(file, mode="r", *a, **kw):
        f = _open(file, mode, *a, **kw)
        return _FullFile(f, file) if any(c in mode for c in "wax+") and _full(file) else f

    builtins.open = _open_full

    import safetensors.torch as _st

    _save_file = _st.save_file

    def _save_file_full(tensors, filename, *a, **kw):
        if _full(filename):
            with _open(filename, "wb") as f:
                f.write(b"\\0" * 16)
            raise _no_space(filename)
        return _save_file(tensors, filename, *a, **kw)

    _st.save_file = _save_file_full
'''


def _tool(args, inject_dir=None, full_under=None):
    env = _env()
    if inject_dir is None:
        return run_cli(args[0], args[1:], env=env, cwd=str(REPO), timeout=600)
    # A new interpreter, which loads the sitecustomize of its PYTHONPATH at start-up.
    env["PYTHONPATH"] = f"{inject_dir}:{env.get('PYTHONPATH', REPO)}"
    env["FULL_UNDER"] = str(full_under)
    return subprocess.run([sys.executable] + [str(a) for a in args], capture_output=True, text=True, env=env,
                          cwd=str(REPO), timeout=600)


def _one_line(r, prefix):
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    assert errors[0].startswith(prefix), errors
    assert " GiB free there)" in errors[0], errors
    return errors[0]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_full")
    inject = root / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    made = {}
    llama = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"]
    for arm in ("tied", "lev"):
        ck = root / f"ck_{arm}"
        r = run_single(tiny_args(2, ["--input-embedding", arm, "--save", str(ck)] + llama))
        assert r.returncode == 0, r.stderr[-3000:]
        made[arm] = ck
    return root, inject, made


CONVERT = REPO / "tools" / "convert_checkpoint.py"


@pytest.mark.parametrize("command, arm, extra, what", [
    ("export-hf", "tied", [], "while writing the Hugging Face export ("),
    ("export-lev", "lev", [], "while writing the LEV parameters ("),
    ("reshard", "tied", ["--target-tp", "2"], "the checkpoint of iteration 2 could not be written (no space left"),
    ("to-lev", "tied", ["--fit-max-steps", "2", "--fit-eval-interval", "1"], "while writing the LEV checkpoint ("),
])
def test_disk_full_in_a_conversion_is_one_line_and_leaves_nothing(sources, command, arm, extra, what):
    root, inject, made = sources
    save = root / f"out_{command}"
    args = [CONVERT, command, "--load", made[arm], "--save", save, "--quiet"] + extra
    r = _tool(args, inject, save)
    msg = _one_line(r, f"error: --save {save}")
    assert what in msg and "make room and run" in msg, msg
    left = sorted(p.name for p in save.rglob("*")) if save.exists() else []
    assert left == [], left  # the partial files were removed
    assert "left in place" not in msg and "remove them" not in msg, msg
    r = _tool(args)  # with room, the same command works
    assert r.returncode == 0, r.stderr[-3000:]


def test_disk_full_while_preprocessing_is_one_line_and_the_rerun_works(sources, tmp_path):
    root, inject, _ = sources
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"text": "{i} {i + 1} {i + 2}"}}\n' for i in range(50)))  # NullTokenizer reads ids
    out = tmp_path / "out"
    args = [REPO / "tools" / "preprocess_data.py", "--input", src, "--output-prefix", out / "ds",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress-bar"]
    r = _tool(args, inject, out)
    msg = _one_line(r, f"error: --output-prefix {out / 'ds'}: no space left on device in {out}")
    assert "the partial files were removed" in msg, msg
    assert sorted(p.name for p in out.glob("*")) == [], list(out.glob("*"))
    r = _tool(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "ds_text_document.bin").exists()
