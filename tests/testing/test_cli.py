"""``run_cli``: a script run in a process forked from the rank server gives what ``subprocess.run`` of a new
interpreter gives: exit code, output (from the file descriptors), argv, environment, working directory,
warnings filters, the wait for non-daemon threads and the exit handlers; and a timeout kills it.
``run_torchrun``: its ranks have torchrun's variables, join one gloo group and share one output; a failed
rank ends the others and the job's exit code is 1, as under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_lev.testing.cli import run_cli, run_torchrun

SCRIPT = textwrap.dedent('''
    import atexit, os, sys, threading, time, warnings
    print("argv", sys.argv[1:])
    print("env", os.environ.get("CLI_TEST_VALUE"), "cwd", os.getcwd())
    print("path0", sys.path[0])
    print("main", __name__)
    warnings.warn("a user warning")
    os.system("echo from a child process")
    os.write(2, b"raw stderr\\n")
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    atexit.register(lambda: print("exit handler"))
    sys.exit(int(sys.argv[1]))
''')


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "probe.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("warnings_env", ["", "ignore"])
def test_a_forked_run_gives_what_a_new_interpreter_gives(script, tmp_path, warnings_env):
    env = dict(os.environ, CLI_TEST_VALUE="42", PYTHONWARNINGS=warnings_env)
    forked = run_cli(script, ["3", "x y"], env=env, cwd=tmp_path, timeout=120)
    fresh = subprocess.run([sys.executable, str(script), "3", "x y"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120)
    assert forked.returncode == fresh.returncode == 3
    assert sorted(forked.stdout.splitlines()) == sorted(fresh.stdout.splitlines())
    assert f"env 42 cwd {tmp_path}" in forked.stdout and "path0 " + str(script.parent) in forked.stdout
    assert "main __main__" in forked.stdout and "argv ['3', 'x y']" in forked.stdout
    assert forked.stdout.splitlines()[-2:] == ["thread done", "exit handler"]  # threads first, then handlers
    assert "from a child process" in forked.stdout and "raw stderr" in forked.stderr
    assert ("a user warning" in forked.stderr) is (warnings_env == "")
    assert forked.stderr == fresh.stderr


def test_errors_and_timeouts(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('boom')\n")
    r = run_cli(bad, timeout=60)
    assert r.returncode == 1 and r.stderr.rstrip().endswith("ValueError: boom") and "Traceback" in r.stderr
    text_exit = tmp_path / "text_exit.py"
    text_exit.write_text("import sys; sys.exit('error: one line')\n")
    r = run_cli(text_exit, timeout=60)
    assert (r.returncode, r.stderr) == (1, "error: one line\n")
    slow = tmp_path / "slow.py"
    slow.write_text("import time; print('started', flush=True); time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_cli(slow, timeout=2)
    assert e.value.output == "started\n"


RANKS = textwrap.dedent('''
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    print("rank", dist.get_rank(), "of", dist.get_world_size(), [os.environ[n] for n in names], flush=True)
    dist.barrier()
    if sys.argv[1] == "fail" and dist.get_rank() == 1:
        sys.exit("error: rank 1 gives up")
    dist.barrier()  # the other ranks wait here for a rank that is gone
    print("done", dist.get_rank(), flush=True)
''')


def test_run_torchrun_gives_the_ranks_torchruns_variables_and_stops_them_when_one_fails(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = run_torchrun(script, ["ok"], nproc=3, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(3):
        assert f"rank {rank} of 3 {[str(rank), str(rank), '3', '3', '1']}" in r.stdout
        assert f"done {rank}" in r.stdout
    r = run_torchrun(script, ["fail"], nproc=3, env=env, timeout=120)  # without the stop: 30 minutes of gloo
    assert r.returncode == 1 and "error: rank 1 gives up" in r.stderr
    assert "done" not in r.stdout and r.stdout.count("rank ") == 3
