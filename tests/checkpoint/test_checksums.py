"""Checkpoint checksums (megatron_lev.checkpoint.checksums): what a save records, what a load refuses.

The flipped-bytes cases of whole training checkpoints (training, the conversions, evaluation) are in
tests/reliability/test_training_faults.py; here the manifest itself, and the two-rank save and load,
where each rank hashes its own shards and verifies its share of the files."""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import pytest
import torch

from megatron_lev.checkpoint import checksums
from megatron_lev.testing import run_distributed


def _flip(path, offset=None, n=512):
    """Change ``n`` bytes inside ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 3 if offset is None else offset
    for i in range(start, min(start + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_manifest_records_every_file_and_finds_each_kind_of_damage(tmp_path):
    files = {"__0_0.distcp": os.urandom(3 << 20), "__1_0.distcp": os.urandom(1000), ".metadata": b"m" * 99,
             "common.pt": b"c" * 10, "metadata.json": b"{}", "config.yaml": b"a: 1\n", ".write-test-x": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "__1_2.distcp").write_bytes(b"after a gap in the numbering")
    assert checksums.files_written_by(str(tmp_path), 1) == ["__1_0.distcp"]  # found by name, in order
    own0 = checksums.files_written_by(str(tmp_path), 0)
    assert own0 == ["__0_0.distcp", ".metadata", "common.pt", "metadata.json"]
    entries = checksums.hash_files(str(tmp_path), own0)
    entries.update(checksums.hash_files(str(tmp_path), ["__1_0.distcp"]))  # rank 1's part
    assert checksums.uncovered(str(tmp_path), entries) == ["__1_2.distcp"]  # rank 0 hashes what none named
    entries.update(checksums.hash_files(str(tmp_path), ["__1_2.distcp"]))
    assert entries["__0_0.distcp"] == (3 << 20, zlib.crc32(files["__0_0.distcp"]))  # streamed = whole
    checksums.write_manifest(str(tmp_path), entries)
    body = json.loads((tmp_path / checksums.MANIFEST).read_text())
    assert body["algorithm"] == "crc32" and set(body["files"]) == set(entries)  # config.yaml is not covered
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    manifest = checksums.read_manifest(str(tmp_path))
    assert manifest == entries and checksums.first_damage(str(tmp_path), manifest) is None

    # Any rank count covers each file once.
    names = sorted(manifest)
    for world in (1, 2, 3, 8):
        shares = [names[r::world] for r in range(world)]
        assert sorted(sum(shares, [])) == names

    big = tmp_path / "__0_0.distcp"
    _flip(big)
    assert big.stat().st_size == 3 << 20
    index, kind = checksums.first_damage(str(tmp_path), manifest)
    file, what = checksums.describe(str(tmp_path), manifest, index, kind)
    assert (file, kind) == (str(big), checksums.WRONG_SUM)
    assert what == f"its bytes changed after the save (CRC32 differs from the {manifest[big.name][1]:08x} " \
                   "recorded in checksums.json)"
    # The rank whose share it is finds it; the other does not.
    i = names.index(big.name)
    assert checksums.first_damage(str(tmp_path), manifest, i % 2, 2) == (i, checksums.WRONG_SUM)
    assert checksums.first_damage(str(tmp_path), manifest, (i + 1) % 2, 2) is None
    big.write_bytes(files["__0_0.distcp"])

    (tmp_path / "common.pt").write_bytes(b"c" * 11)
    assert checksums.describe(str(tmp_path), manifest, *checksums.first_damage(str(tmp_path), manifest))[1] == \
        "11 bytes where the save wrote 10"
    (tmp_path / "common.pt").unlink()
    assert checksums.first_damage(str(tmp_path), manifest) == (names.index("common.pt"), checksums.MISSING)

    (tmp_path / checksums.MANIFEST).write_text('{"algorithm": "crc32", "files": {"a": {"bytes": 1}}}')
    with pytest.raises(checksums.ManifestError, match=r"^unreadable \(KeyError"):
        checksums.read_manifest(str(tmp_path))
    (tmp_path / checksums.MANIFEST).write_text('{"algorithm": "sha1", "files": {}}')
    with pytest.raises(checksums.ManifestError, match="algorithm 'sha1' is not 'crc32'"):
        checksums.read_manifest(str(tmp_path))
    (tmp_path / checksums.MANIFEST).unlink()
    assert checksums.read_manifest(str(tmp_path)) is None


def _save_then_damage_and_verify(ckpt_dir: str):
    """A real two-rank dist_checkpointing save with save_checkpoint's checksum steps, then a byte flipped
    in the file of the other rank's share: both ranks refuse, with the same line."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_lev.checkpoint import CheckpointError
    from megatron_lev.checkpoint.sharded import _gather_own_checksums, _install_write_queue, _save_strategy, \
        _write_checksums, verify_checksums

    rank = torch.distributed.get_rank()
    world = parallel_state.get_data_parallel_world_size()
    local = torch.arange(4096.0).reshape(2, 2048) + 10 * rank
    state = {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world), replica_id=0)}
    _install_write_queue()
    dist_checkpointing.save(state, ckpt_dir, sharded_strategy=_save_strategy())
    parts = _gather_own_checksums(ckpt_dir, rank)
    if rank == 0:
        _write_checksums(ckpt_dir, parts)
    torch.distributed.barrier()
    manifest = checksums.read_manifest(ckpt_dir)
    written = {n for n in os.listdir(ckpt_dir) if n != checksums.MANIFEST}
    warnings = []
    verify_checksums(os.path.dirname(ckpt_dir), 1, ckpt_dir, log=warnings.append)  # intact: passes
    torch.distributed.barrier()
    names = sorted(manifest)
    victim = names[1]  # rank 1's share at world 2
    if rank == 0:
        _flip(Path(ckpt_dir) / victim, offset=0, n=8)
    torch.distributed.barrier()
    try:
        verify_checksums(os.path.dirname(ckpt_dir), 1, ckpt_dir, log=warnings.append)
        refusal = None
    except CheckpointError as e:
        refusal = str(e)
    torch.distributed.barrier()
    # One rank's own check failed (its filesystem, a file it sees short): every rank stops with that line
    # rather than the others going on into the load's collectives.
    try:
        verify_checksums(os.path.dirname(ckpt_dir), 1, ckpt_dir, log=warnings.append,
                         local_error="rank 1's own finding" if rank == 1 else None)
        local = None
    except CheckpointError as e:
        local = str(e)
    torch.distributed.barrier()
    if rank == 0:
        # The damage undone (flipped back): without a manifest a load reads the common state to learn whether
        # its save wrote one, and from megatron-core 0.19 the victim, rank 0's shard, holds that state.
        _flip(Path(ckpt_dir) / victim, offset=0, n=8)
        os.remove(os.path.join(ckpt_dir, checksums.MANIFEST))  # as an older release wrote it
    torch.distributed.barrier()
    older = []
    verify_checksums(os.path.dirname(ckpt_dir), 1, ckpt_dir, log=older.append)
    own = sorted(n for n in parts[0][0]) if rank == 0 else None
    # A fresh run's --save appears while the ranks start (another rank's TensorBoard writer makes it): the
    # ranks that look before it exists and those that look after make the same collective calls.
    from types import SimpleNamespace

    from megatron_lev.checkpoint import refuse_newer_checkpoints

    save = os.path.join(os.path.dirname(ckpt_dir), "fresh_save")
    flags = SimpleNamespace(load=save, save=save, overwrite_checkpoints=False, finetune=False, ckpt_step=None)
    if rank == 1:
        time.sleep(0.3)  # rank 0 has looked by now, before the folder exists
        os.makedirs(save)
    refuse_newer_checkpoints(flags, checksums_on=True)
    torch.distributed.barrier()
    return {"manifest": sorted(manifest), "written": sorted(written), "victim": victim, "refusal": refusal,
            "warnings": warnings, "older": older, "local": local, "rank0_parts": own, "parts_len": None if parts is None else len(parts),
            "late_tracker": _late_tracker_load(os.path.join(os.path.dirname(ckpt_dir), "late_tracker")),
            "late_load_dir": _late_load_dir(os.path.join(os.path.dirname(ckpt_dir), "late_load_dir")),
            "bad_manifest": _bad_manifest_unreadable_around_rank_1(ckpt_dir),
            "failed_save": _failed_save_tracker_unreadable_on_rank_1(os.path.dirname(ckpt_dir))}


def _failing(*_a, **_kw):
    raise OSError(5, "Input/output error")


def _bad_manifest_unreadable_around_rank_1(ckpt_dir: str):
    """A bad checksums.json, and rank 1's filesystem failing as its line looks for an older checkpoint:
    every rank raises rank 0's line (rank 1 does not leave the others waiting in the verdicts' all-gather)."""
    from megatron_lev.checkpoint import CheckpointError, sharded

    rank = torch.distributed.get_rank()
    if rank == 0:
        with open(os.path.join(ckpt_dir, checksums.MANIFEST), "w") as f:
            f.write("{not json")
    torch.distributed.barrier()
    saved = sharded.damaged_checkpoint_message
    if rank == 1:
        sharded.damaged_checkpoint_message = _failing
    try:
        sharded.verify_checksums(os.path.dirname(ckpt_dir), 1, ckpt_dir, log=lambda _line: None)
        line = None
    except CheckpointError as e:
        line = str(e)
    finally:
        sharded.damaged_checkpoint_message = saved
    torch.distributed.barrier()
    return line


def _failed_save_tracker_unreadable_on_rank_1(root: str):
    """A save failed on every rank, and rank 1 cannot read the tracker for its line: rank 1 raises the failed
    save's line too, and meets the others in the barrier training makes before it exits on a failed save."""
    from megatron_lev.checkpoint import sharded

    saved = sharded.read_tracker
    if torch.distributed.get_rank() == 1:
        sharded.read_tracker = _failing
    try:
        line = str(sharded._save_failed(root, 2, os.path.join(root, "iter_0000002"),
                                        OSError(28, "No space left on device"), True))
    finally:
        sharded.read_tracker = saved
    torch.distributed.barrier()
    return line


def _late_tracker_load(root: str):
    """--load's tracker appears while the ranks start (a save of another job completing): rank 0 looks
    before it exists, rank 1 after. Both go the same way, with rank 0's view: no rank loads (and waits in
    the load's collectives) while another trains from scratch."""
    from megatron_lev.checkpoint import CheckpointError, load_checkpoint
    from megatron_lev.checkpoint.files import TRACKER

    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(root)
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(0.3)  # rank 0 has looked by now
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write("3\n")
    try:
        outcome = load_checkpoint(root, [], None, None, run_args={}, log=lambda _line: None)
    except CheckpointError as e:  # rank 0 looked late after all: the missing iter_0000003, on both ranks
        outcome = str(e)
    torch.distributed.barrier()
    return outcome


def _late_load_dir(load: str):
    """--ckpt-step with a --load that rank 0's TensorBoard writer creates while the ranks start: whether
    the weights come from the checkpoint (LEV's initialisation, collective over TP, skipped) is rank 0's
    answer on every rank."""
    from types import SimpleNamespace

    from megatron_lev.training.loop import _will_load_checkpoint

    if torch.distributed.get_rank() == 1:
        time.sleep(0.3)  # rank 0 has looked by now, before the folder exists
        os.makedirs(load)
    verdict = _will_load_checkpoint(SimpleNamespace(checkpointing=SimpleNamespace(load=load, ckpt_step=5)))
    torch.distributed.barrier()
    return verdict


def test_two_ranks_hash_their_own_shards_and_share_the_verification(tmp_path):
    ck = tmp_path / "iter_0000001"
    ck.mkdir()
    results = run_distributed(_save_then_damage_and_verify, world_size=2, args=(str(ck),))
    r0, r1 = results
    assert r0["manifest"] == r0["written"], "the manifest covers every file of the save"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(r0["manifest"])
    assert r0["parts_len"] == 2 and r1["parts_len"] is None  # gathered on rank 0 only
    assert "__1_0.distcp" not in r0["rank0_parts"], "rank 1's shard is hashed by rank 1"
    assert r0["warnings"] == [] and r1["warnings"] == []
    assert r0["refusal"] is not None and r0["refusal"] == r1["refusal"], (r0["refusal"], r1["refusal"])
    assert r0["refusal"].startswith(f"{ck / r0['victim']}: its bytes changed after the save"), r0["refusal"]
    assert "nothing was loaded" in r0["refusal"] and "\n" not in r0["refusal"]
    assert r0["local"] == r1["local"] == "rank 1's own finding"
    # Without a manifest: one warning line, on rank 0 only.
    assert r0["older"] == [checksums.no_manifest_warning(str(ck))] and r1["older"] == []
    assert r0["late_tracker"] == r1["late_tracker"], (r0["late_tracker"], r1["late_tracker"])
    assert r0["late_load_dir"] == r1["late_load_dir"], (r0["late_load_dir"], r1["late_load_dir"])
    assert r0["bad_manifest"] == r1["bad_manifest"], (r0["bad_manifest"], r1["bad_manifest"])
    assert r0["bad_manifest"].startswith(f"{ck / checksums.MANIFEST}: "), r0["bad_manifest"]  # rank 0's own line
    for line in (r0["failed_save"], r1["failed_save"]):  # each rank's free space figure aside, the same line
        assert line.startswith(f"--save {tmp_path}: the checkpoint of iteration 2 could not be written (no space"), line
        assert "there is no complete checkpoint yet" in line, line
