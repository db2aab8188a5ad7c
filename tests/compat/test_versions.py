"""What differs between megatron-core releases (megatron_lev.compat.versions): checkpoint refusal and the
once-per-process deprecation notice."""

from __future__ import annotations

import logging

import pytest
from packaging.version import Version

from megatron_lev.compat import versions


@pytest.fixture
def running(monkeypatch):
    def set_version(v: str) -> None:
        monkeypatch.setattr(versions, "megatron_core_version", lambda: Version(v))

    return set_version


def test_checkpoint_from_an_older_or_same_release_is_read(running):
    running("0.19.2")
    assert versions.checkpoint_refusal("0.16.1", "ckpt/iter_0000005") is None
    assert versions.checkpoint_refusal(None, "ckpt/iter_0000005") is None  # written before the field existed
    assert versions.checkpoint_refusal("0.19.0", "ckpt/iter_0000005") is None
    running("0.16.1")
    assert versions.checkpoint_refusal(None, "ckpt/iter_0000005") is None


def test_checkpoint_from_a_newer_release_is_refused_in_one_line(running):
    running("0.16.1")
    msg = versions.checkpoint_refusal("0.19.2", "ckpt/iter_0000005")
    assert msg is not None and "\n" not in msg
    assert msg.startswith("ckpt/iter_0000005: written by megatron-core 0.19.2")
    assert "0.16.1" in msg and "convert_checkpoint.py" in msg


def test_installed_version_is_one_of_the_supported():
    v = versions.megatron_core_version()
    assert Version("0.16.1") <= v < Version("0.20"), v


def test_gpt_deprecation_notice_passes_once(monkeypatch, caplog):
    monkeypatch.setattr(versions, "_QUIETED", False)
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    before = list(logger.filters)
    # A model built earlier in this process left a filter that has already passed its one line.
    logger.filters[:] = [f for f in before if not isinstance(f, versions._Once)]
    try:
        versions.quiet_repeated_warnings()
        versions.quiet_repeated_warnings()  # idempotent: one filter
        assert sum(isinstance(f, versions._Once) for f in logger.filters) == 1
        with caplog.at_level(logging.WARNING, logger=logger.name):
            for _ in range(3):
                logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
            logger.warning("another warning")
        messages = [r.getMessage() for r in caplog.records]
        assert sum(m.startswith("GPTModel IS DEPRECATED") for m in messages) == 1
        assert "another warning" in messages
    finally:
        logger.filters[:] = before


def _checkpoint_dir(tmp_path, *, common_pt: bool):
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    if common_pt:
        (tmp_path / "common.pt").write_bytes(b"")
    return str(tmp_path)


def test_checkpoint_without_common_pt_is_refused_where_its_reader_is_missing(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing import serialization

    path = _checkpoint_dir(tmp_path, common_pt=False)
    if hasattr(serialization, "_legacy_common_state_exists"):  # 0.19: reads both layouts
        assert versions.unreadable_checkpoint(path) is None
        monkeypatch.delattr(serialization, "_legacy_common_state_exists")  # as 0.16.1
    msg = versions.unreadable_checkpoint(path)
    assert msg is not None and "\n" not in msg and "no common.pt" in msg and "import-hf" in msg
    assert versions.unreadable_checkpoint(_checkpoint_dir(tmp_path, common_pt=True)) is None


def test_checkpoint_writer_errors_are_recorded_where_the_save_drops_them(tmp_path):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync as Writer

    before = Writer.__dict__["write_preloaded_data"]
    threaded = hasattr(Writer, "write_preloaded_data_multithread")  # 0.19: the writers are threads of this process
    with versions.checkpoint_writer_errors() as errors:
        if threaded:
            bucket = (str(tmp_path / "absent" / "__0_0.distcp"), "__0_0", ([], []))
            index, result = Writer.write_preloaded_data([], 0, bucket, None, None, False)
            assert index == 0 and isinstance(result, FileNotFoundError)
            assert errors == [result]
        else:  # up to 0.16.1: forked writers, whose errors reach the save's exception intact
            assert Writer.__dict__["write_preloaded_data"] is before
            assert errors == []
    assert Writer.__dict__["write_preloaded_data"] is before


def test_te_apex_fallback_warnings_are_dropped_and_others_kept(monkeypatch):
    """megatron-core's six import-time TE/Apex fallback warnings stay out of every start (here: --help with
    Python's default warning filters); other warnings still show; a CUDA start says it in one line."""
    import subprocess
    import sys
    import warnings
    from pathlib import Path

    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONWARNINGS"}
    repo = Path(__file__).resolve().parents[2]
    # --help as the script runs it, then what the start imported (the same process: one start's imports).
    probe = ("import runpy, sys\n"
             f"sys.argv = [{str(repo / 'pretrain_lev.py')!r}, '--help']\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
             "import megatron.core.jit, torch\n"
             "print('PROBE', code, 'torch._dynamo' in sys.modules, megatron.core.jit.jit_fuser.__name__,"
             " torch.compile.__module__)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "--input-embedding" in r.stdout, r.stderr[-2000:]
    assert "not installed. Falling back" not in r.stderr, r.stderr
    # megatron-core's import-time torch.compile decorations are deferred to their first call (compat/startup.py):
    # the start imports no TorchDynamo, megatron's jit_fuser is the deferring one, torch.compile is torch's again.
    assert r.stdout.splitlines()[-1] == "PROBE 0 False deferred_compile torch", r.stdout[-500:]

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        versions.quiet_fallback_warnings()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("a megatron-core warning users can act on (test_versions)", UserWarning)
    assert [str(w.message) for w in seen] == ["a megatron-core warning users can act on (test_versions)"]

    found = {"transformer_engine": None, "apex": None}
    monkeypatch.setattr(versions.importlib.util, "find_spec", lambda name: found.get(name))
    notice = versions.fallback_notice()
    assert notice.startswith("note: Transformer Engine and Apex are not installed") and "\n" not in notice
    found["apex"] = object()
    assert versions.fallback_notice() is None


def test_deferred_compile_compiles_once_at_the_first_call_with_the_options():
    from megatron_lev.compat.startup import _deferred

    calls = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    deferred = _deferred(fake_compile)

    @deferred
    def add(a, b):
        """Adds."""
        return a + b

    @deferred(dynamic=False)
    def mul(a, b):
        return a * b

    assert calls == [] and add.__name__ == "add" and add.__doc__ == "Adds."
    assert add(1, 2) == ("compiled", 3) and add(2, 2) == ("compiled", 4)
    assert mul(2, 3) == ("compiled", 6)
    assert calls == [("add", {}), ("mul", {"dynamic": False})]


def test_a_deferred_compile_runs_cpu_tensors_uncompiled_and_compiles_for_a_device():
    import torch

    from megatron_lev.compat.startup import _deferred

    calls = []

    def fake_compile(fn, **options):
        calls.append(fn.__name__)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    @_deferred(fake_compile)
    def scale(x, factor=None):
        return x * (2 if factor is None else factor)

    x = torch.ones(3)
    assert torch.equal(scale(x), x * 2) and torch.equal(scale(x, factor=torch.tensor(3.0)), x * 3)
    assert calls == []  # CPU tensors only: as written, Inductor's C++ build never started
    on_device = torch.ones(3, device="meta")  # another device than the CPU (no CUDA here)
    assert scale(on_device)[0] == "compiled" and scale(on_device, factor=torch.tensor(3.0))[0] == "compiled"
    assert calls == ["scale"]  # compiled once, at the first call with a device tensor


def test_the_deferring_finder_stays_inert_after_its_import_and_a_new_call_arms_a_new_one(monkeypatch):
    """It never leaves sys.meta_path (a removal while another thread walks the list makes that walk skip a
    finder); once used it finds nothing, and defer_megatron_compiles arms a fresh one for a re-import."""
    import sys

    from megatron_lev.compat import startup

    import megatron

    used = startup._Finder()
    spec = used.find_spec("megatron.core", megatron.__path__)
    assert isinstance(spec.loader, startup._DeferringLoader)
    assert used.find_spec("megatron.core", megatron.__path__) is None
    monkeypatch.setattr(sys, "meta_path", [used, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    finders = lambda: sum(isinstance(f, startup._Finder) for f in sys.meta_path)  # noqa: E731
    before = finders()
    startup.defer_megatron_compiles()
    assert sys.meta_path[1] is used and isinstance(sys.meta_path[0], startup._Finder) and not sys.meta_path[0]._done
    startup.defer_megatron_compiles()  # armed: no second one
    assert finders() == before + 1
