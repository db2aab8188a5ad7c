"""The Pile launch scripts (examples/pile/*.sh, train.sbatch) run as written, scaled down to one machine.

* preprocess_pile.sh as two "nodes" over a Pile-shaped folder written here (2 training shards plus
  val/test, a 256-byte .tiktoken vocabulary): every shard is tokenised exactly once by its node; a node
  killed in the middle of a shard, with the files an interrupted write leaves, redoes that shard on the
  rerun; finished shards are skipped; data_path.txt appears only once every shard is done and names them.
* train.sh as two nodes x one process (two torchrun agents, NNODES=2, NODE_RANK, MASTER_ADDR=127.0.0.1)
  with TP=2 across the nodes, the 200m config shrunk through EXTRA: it trains, checkpoints, stops
  (--exit-interval) and the same command resumes.
* train.sbatch under a simulated allocation: the Slurm variables it reads and stand-ins for srun (one task
  per node) and scontrol on PATH. SIGTERM is delivered as --signal=TERM@120 does, to every process of
  the job step (torchrun agents, ranks, their helper processes): the ranks save and exit, the script
  requeues the job and exits 0, and the requeued job resumes and finishes.
  The four training launches see the same iterations bit for bit (loss and gradient norm), whatever
  iteration the signal stopped at.
* Missing inputs: each script stops with one line that names what is missing.

What a real cluster adds (NCCL, InfiniBand, GPUs, node failures) is not simulated here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lev.testing import free_port, train_records

REPO = Path(__file__).resolve().parents[2]
PILE_DIR = REPO / "examples" / "pile"
NUM_SHARDS = 2
DOCS_PER_SHARD = 60
TRAIN_ITERS = 12

pytestmark = [pytest.mark.scripts, pytest.mark.slow]  # several torchrun jobs, ~63 s on 2 cores

# The 200m config shrunk to a toy; everything else (bf16, distributed optimizer, LEV compute mode, the
# SIGTERM handler) comes from the config file itself.
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
    f"--train-iters {TRAIN_ITERS} --lr-warmup-iters 2 --eval-interval 1000 --eval-iters 1 --save-interval 4 "
    "--log-interval 1 --lev-seed-dim 16 --lev-rank 8 --lev-heads 2 --lev-knots 8 "
    "--tensor-model-parallel-size 2 --num-workers 1 --quiet-config"
)

SRUN = r"""#!/usr/bin/env bash
# Stand-in for srun inside an allocation: one task per node (SLURM_NNODES), each with its node's
# variables; records its arguments and pid so that the test can signal the step's processes.
set -u
echo "$*" >> "$FAKE_SLURM_DIR/srun.args"
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
echo $$ > "$FAKE_SLURM_DIR/srun.pid"
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_STEP_ID=0 SLURMD_NODENAME=node$i "$@" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
"""

SCONTROL = r"""#!/usr/bin/env bash
# Stand-in for scontrol: the allocation's host names (all this machine) and requeue (recorded).
echo "$*" >> "$FAKE_SLURM_DIR/scontrol.log"
case "$1 ${2:-}" in
  "show hostnames") for ((i = 0; i < SLURM_NNODES; i++)); do echo 127.0.0.1; done ;;
  "requeue "*) ;;
  *) echo "scontrol stand-in: unsupported: $*" >&2; exit 1 ;;
esac
"""


def _write_jsonl_zst(path: Path, docs) -> None:
    import zstandard

    text = "".join(json.dumps({"text": d, "meta": {"pile_set_name": "Pile-CC"}}) + "\n" for d in docs)
    path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A Pile-shaped folder, a byte-level .tiktoken vocabulary, stand-ins for srun/scontrol, and the env."""
    from megatron_lev.tokenizer import write_tiktoken_file

    root = tmp_path_factory.mktemp("pile")
    pile = root / "pile"
    pile.mkdir()
    rng = random.Random(0)
    words = "the of and a to in is was that for on with as by at from his her an which".split()
    for s in [f"{i:02d}" for i in range(NUM_SHARDS)] + ["val", "test"]:
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(DOCS_PER_SHARD)]
        _write_jsonl_zst(pile / f"{s}.jsonl.zst", docs)
    tok = root / "bytes.tiktoken"  # 256 byte tokens; the gpt2 pattern puts <|endoftext|> at 256
    write_tiktoken_file({bytes([i]): i for i in range(256)}, str(tok))
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TIKTOKEN_PATTERN="gpt2",
               TOKENIZER=str(tok), PYTHONPATH=str(REPO),
               # the project's interpreter and torchrun first, then the Slurm stand-ins
               PATH=os.pathsep.join([str(Path(sys.executable).parent), str(bin_dir), os.environ["PATH"]]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK",
              "EXTRA", "CKPT_ROOT", "PILE_DATA", "PILE", "OUT"):
        env.pop(k, None)
    for k in [k for k in env if k.startswith("SLURM_")]:
        del env[k]
    return {"root": root, "pile": pile, "tok": tok, "env": env}


def _preprocess(tree, node):
    """One node's run, in its own process group (so that the whole node can be killed)."""
    return subprocess.Popen(["bash", str(PILE_DIR / "preprocess_pile.sh")], env=_preprocess_env(tree, node),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def preprocessed(tree):
    """Two nodes at once; node 0 is killed (SIGKILL to its process group) as it starts shard 'val', then
    the files an interrupted write leaves are put there; node 0 reruns, node 1 reruns."""
    out = tree["root"] / "out"
    n0, n1 = _preprocess(tree, 0), _preprocess(tree, 1)
    log0 = ""
    for line in n0.stdout:
        log0 += line
        if line.startswith("shard val: tokenising"):
            time.sleep(0.5)  # the tool is running (its imports alone take seconds)
            os.killpg(n0.pid, signal.SIGKILL)
            break
    n0.wait(timeout=60)
    log1 = n1.communicate(timeout=300)[0]
    assert n1.returncode == 0, log1
    state_after_kill = {"idx": (out / "pile_val_text_document.idx").exists(),
                        "data_path": (out / "data_path.txt").exists()}
    # What a write interrupted at any point can leave: temporaries, and the .bin and token counts
    # renamed into place before the .idx.
    for name in ("pile_val_text_document.bin.partial", "pile_val_text_document.idx.partial",
                 "pile_val_text_document.bin", "pile_val_text_token_counts.npy"):
        (out / name).write_bytes(b"left by an interrupted run")
    rerun0 = subprocess.run(["bash", str(PILE_DIR / "preprocess_pile.sh")], env=_preprocess_env(tree, 0),
                            capture_output=True, text=True, timeout=300)
    data_path = (out / "data_path.txt").read_text() if (out / "data_path.txt").exists() else None
    rerun1 = subprocess.run(["bash", str(PILE_DIR / "preprocess_pile.sh")], env=_preprocess_env(tree, 1),
                            capture_output=True, text=True, timeout=300)
    return {"out": out, "logs": [log0, log1, rerun0.stdout, rerun1.stdout], "after_kill": state_after_kill,
            "rerun0": rerun0, "rerun1": rerun1, "data_path_after_node0": data_path, "n0_rc": n0.returncode}


def _preprocess_env(tree, node):
    return dict(tree["env"], PILE=str(tree["pile"]), OUT=str(tree["root"] / "out"), NUM_SHARDS=str(NUM_SHARDS),
                WORKERS="1", NNODES="2", NODE_RANK=str(node))


@pytest.mark.slow
def test_preprocess_two_nodes_each_shard_once_restart_redoes_the_killed_shard(preprocessed):
    import numpy as np

    p = preprocessed
    out = p["out"]
    assert p["n0_rc"] == -signal.SIGKILL
    assert p["rerun0"].returncode == 0, p["rerun0"].stderr[-3000:]
    assert p["rerun1"].returncode == 0, p["rerun1"].stderr[-3000:]
    # The killed node left no .idx for 'val', and nobody wrote a blend while 'val' was missing.
    assert p["after_kill"] == {"idx": False, "data_path": False}
    log0, log1, rerun0, rerun1 = p["logs"]
    started = [ln.split()[1].rstrip(":") + "@" + ln.split()[-1] for log in p["logs"] for ln in log.splitlines()
               if ln.startswith("shard ") and "tokenising" in ln]
    # Node r takes shards r, r+2, ... of 00, 01, val, test; only the killed 'val' is started twice.
    assert sorted(started) == sorted(["00@0/2", "01@1/2", "val@0/2", "test@1/2", "val@0/2"]), started
    assert "shard 00: done, skipped" in rerun0 and "shard val: tokenising" in rerun0
    assert "shard 01: done, skipped" in rerun1 and "shard test: done, skipped" in rerun1
    assert "tokenising" not in rerun1
    waiting = [ln for ln in log1.splitlines() if "still to do on other nodes:" in ln]
    assert len(waiting) == 1 and "val" in waiting[0].split(":")[1], log1
    blend = " ".join(f"1 {out}/pile_{i:02d}_text_document" for i in range(NUM_SHARDS))
    assert p["data_path_after_node0"].split() == blend.split()
    assert (out / "data_path.txt").read_text().split() == blend.split()
    for s in [f"{i:02d}" for i in range(NUM_SHARDS)] + ["val", "test"]:
        pre = out / f"pile_{s}_text_document"
        counts = np.load(out / f"pile_{s}_text_token_counts.npy")
        assert counts.size == 257 and counts[256] == DOCS_PER_SHARD, s  # one EOD per document
        assert pre.with_suffix(".bin").stat().st_size == 2 * counts.sum(), s  # uint16 ids, the whole shard
        assert pre.with_suffix(".idx").stat().st_size > 0
    assert not list(out.glob("*.partial")), list(out.glob("*.partial"))


def test_missing_inputs_fail_with_one_line(tree, tmp_path):
    env = dict(tree["env"], TORCHRUN="false", CKPT_ROOT=str(tmp_path / "ck"))  # nothing may launch
    empty = tmp_path / "empty"
    empty.mkdir()
    ready = tmp_path / "ready"
    ready.mkdir()
    (ready / "data_path.txt").write_text("1 x\n")
    pre = str(PILE_DIR / "preprocess_pile.sh")
    train = str(PILE_DIR / "train.sh")
    cases = [
        (["bash", pre], dict(OUT=str(tmp_path / "o")), "set PILE"),
        (["bash", pre], dict(PILE=str(tree["pile"]), OUT=str(tmp_path / "o"), NUM_SHARDS="3"),
         "lacks 02.jsonl.zst"),
        (["bash", pre], dict(PILE=str(tree["pile"]), OUT=str(tmp_path / "o"), NUM_SHARDS=str(NUM_SHARDS),
                             TOKENIZER=str(tmp_path / "none.tiktoken")), "TOKENIZER="),
        (["bash", train, "200m", "lev"], dict(), "set PILE_DATA"),
        (["bash", train, "200m", "lev"], dict(PILE_DATA=str(empty)), "has no data_path.txt"),
        (["bash", train, "300m", "lev"], dict(PILE_DATA=str(empty)), "unknown SCALE '300m'"),
        (["bash", train, "200m", "dense"], dict(PILE_DATA=str(empty)), "unknown ARM 'dense'"),
        (["bash", train, "200m"], dict(), "usage: train.sh SCALE ARM"),
        (["bash", str(PILE_DIR / "train.sbatch"), "200m", "lev"], dict(), "not inside a Slurm job"),
    ]
    cases.append((["bash", train, "200m", "lev"], dict(PILE_DATA=str(ready), TOKENIZER=str(tmp_path / "none")),
                  f"TOKENIZER={tmp_path / 'none'}: no such file"))
    cases.append((["bash", str(PILE_DIR / "train.sbatch"), "1.2b", "lev"],
                  dict(PILE_DATA=str(ready), TOKENIZER=str(tmp_path / "none"), SLURM_JOB_ID="7", SLURM_NNODES="2",
                       SLURM_JOB_NODELIST="node[0-1]", SLURM_SUBMIT_DIR=str(REPO),
                       FAKE_SLURM_DIR=str(tmp_path)), "TOKENIZER="))
    for cmd, extra, needle in cases:
        r = subprocess.run(cmd, env=dict(env, **extra), capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (cmd, extra, r.returncode, r.stderr)
    assert not (tmp_path / "srun.args").exists()  # nothing was launched


def _train_env(tree, preprocessed, ckpt_root, metrics, extra=""):
    return dict(tree["env"], PILE_DATA=str(preprocessed["out"]), GPUS_PER_NODE="1", CKPT_ROOT=str(ckpt_root),
                MASTER_PORT=str(free_port()), EXTRA=f"{TINY} --metrics-file {metrics} {extra}".strip())


def _sbatch(tree, env, log):
    """Submit: run a copy of train.sbatch (as Slurm does, from its spool folder) in the submit folder."""
    spool = tree["root"] / "spool"
    spool.mkdir(exist_ok=True)
    script = spool / "slurm_script"
    script.write_text((PILE_DIR / "train.sbatch").read_text())
    return subprocess.Popen(["bash", str(script), "200m", "lev"], env=env, cwd=str(REPO), stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def _tail(path: Path, n=6000) -> str:
    return path.read_text()[-n:] if path.exists() else ""


def _kill_trees(procs) -> None:
    """SIGKILL each still-running process and everything under it."""
    import psutil

    for p in procs:
        if p.poll() is not None:
            continue
        try:
            tree = psutil.Process(p.pid).children(recursive=True) + [psutil.Process(p.pid)]
        except psutil.NoSuchProcess:
            continue
        for q in tree:
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass
        p.wait()


@pytest.fixture(scope="module")
def slurm_run(tree, preprocessed):
    """Submission 1 gets SIGTERM on every process of its step after the checkpoint at iteration 4;
    submission 2 (the requeued job) resumes."""
    import psutil

    root = tree["root"]
    fake = root / "slurm"
    fake.mkdir()
    metrics = root / "slurm_metrics.jsonl"
    env = _train_env(tree, preprocessed, root / "slurm_ck", metrics)
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="lev-pile", SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node[0-1]", SLURM_SUBMIT_DIR=str(REPO), SLURM_NTASKS_PER_NODE="1",
               SLURM_RESTART_COUNT="0", FAKE_SLURM_DIR=str(fake))
    jobs = []
    try:
        log1 = root / "job1.out"
        with open(log1, "w") as f:
            job = _sbatch(tree, env, f)
            jobs.append(job)
            deadline = time.time() + 240
            while "successfully saved checkpoint from iteration       4" not in _tail(log1, 10**7):
                assert job.poll() is None, _tail(log1)
                assert time.time() < deadline, "no checkpoint at iteration 4:\n" + _tail(log1)
                time.sleep(0.05)
            # --signal=TERM@120: every process of the job step (not srun, not the batch shell).
            step = psutil.Process(int((fake / "srun.pid").read_text())).children(recursive=True)
            for proc in step:
                try:
                    proc.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass
            job.wait(timeout=240)
        first = log1.read_text()
        env["SLURM_RESTART_COUNT"] = "1"
        log2 = root / "job2.out"
        with open(log2, "w") as f:
            job2 = _sbatch(tree, env, f)
            jobs.append(job2)
            job2.wait(timeout=300)
    finally:  # a job that failed the test leaves no training processes to the rest of the suite
        _kill_trees(jobs)
    return {"rc1": job.returncode, "log1": first, "rc2": job2.returncode, "log2": log2.read_text(),
            "signalled": len(step), "metrics": train_records(metrics), "ckpt": root / "slurm_ck" / "pile_200m_lev",
            "fake": fake}


@pytest.mark.slow
def test_sbatch_sigterm_saves_requeues_and_the_requeued_job_resumes(slurm_run):
    s = slurm_run
    assert s["rc1"] == 0, s["log1"][-6000:]
    stops = [ln for ln in s["log1"].splitlines() if "exiting on SIGTERM at iteration" in ln]
    assert len(stops) == 1, s["log1"][-6000:]
    k = int(stops[0].split()[-1])
    assert 4 <= k < TRAIN_ITERS
    # Two torchrun agents, two ranks and each rank's data-loader worker (saves start no writer process).
    assert s["signalled"] >= 6, s["signalled"]
    assert f"successfully saved checkpoint from iteration {k:7d}" in s["log1"]
    assert "forcefully exiting" not in s["log1"]  # no rank was killed: all saved and exited
    assert f"stopped at iteration {k} of {TRAIN_ITERS}" in s["log1"] and "requeueing job 4242" in s["log1"]
    assert (s["fake"] / "scontrol.log").read_text().splitlines() == ["show hostnames node[0-1]", "requeue 4242",
                                                                    "show hostnames node[0-1]"]
    assert (s["fake"] / "srun.args").read_text().splitlines()[0].startswith("--kill-on-bad-exit=1 bash")
    # The requeued job resumes from that checkpoint and finishes.
    assert s["rc2"] == 0, s["log2"][-6000:]
    assert f"(restart 1) on 2 nodes: 200m lev from iteration {k}" in s["log2"]
    assert "successfully loaded checkpoint from" in s["log2"] and f"at iteration {k}" in s["log2"]
    assert f"training finished: iteration {TRAIN_ITERS} of {TRAIN_ITERS}" in s["log2"]
    assert sorted(s["metrics"]) == list(range(1, TRAIN_ITERS + 1))
    assert (s["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)


@pytest.mark.slow
def test_train_sh_two_nodes_tp2_trains_checkpoints_and_resumes_bit_exactly(tree, preprocessed, slurm_run):
    root = tree["root"]
    k = int([ln for ln in slurm_run["log1"].splitlines() if "exiting on SIGTERM" in ln][0].split()[-1])
    # Stop where the Slurm run did not, so that each run's resumed iterations meet the other's
    # uninterrupted ones.
    stop = 6 if k != 6 else 7
    metrics = root / "train_sh_metrics.jsonl"
    env = _train_env(tree, preprocessed, root / "ck", metrics, f"--exit-interval {stop}")
    env.update(NNODES="2", MASTER_ADDR="127.0.0.1")
    cmd = ["bash", str(PILE_DIR / "train.sh"), "200m", "lev"]
    logs = []
    for run in range(2):  # the same command twice
        paths = [root / f"train_sh_{run}_node{r}.log" for r in (0, 1)]
        agents = []
        for r, path in enumerate(paths):
            with open(path, "w") as f:
                agents.append(subprocess.Popen(cmd, env=dict(env, NODE_RANK=str(r)), stdout=f,
                                               stderr=subprocess.STDOUT, cwd=str(root)))
        for a, path in zip(agents, paths):
            a.wait(timeout=300)
            assert a.returncode == 0, _tail(path)
        logs.append(paths[0].read_text())  # node 0 holds rank 0, which logs
    ck = root / "ck" / "pile_200m_lev"
    assert f"exiting at iteration {stop} (--exit-interval)" in logs[0]
    assert f"successfully saved checkpoint from iteration {stop:7d}" in logs[0]
    assert "successfully loaded checkpoint from" in logs[1] and f"at iteration {stop}" in logs[1]
    assert f"training from iteration {stop} to {TRAIN_ITERS}" in logs[1]
    assert "DP=1, TP=2, PP=1" in logs[0]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)
    m = train_records(metrics)
    assert sorted(m) == list(range(1, TRAIN_ITERS + 1))
    assert m[TRAIN_ITERS]["lm loss"] < m[1]["lm loss"] - 0.3, (m[1]["lm loss"], m[TRAIN_ITERS]["lm loss"])
    # Bit for bit the Slurm run's iterations (resumed after SIGTERM at k; here after the stop).
    ref = slurm_run["metrics"]
    for i in range(1, TRAIN_ITERS + 1):
        assert m[i]["lm loss hex"] == ref[i]["lm loss hex"], (i, m[i]["lm loss"], ref[i]["lm loss"])
        assert m[i]["grad norm"] == ref[i]["grad norm"], i
