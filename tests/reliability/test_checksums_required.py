"""What a checkpoint's own metadata promises is held on every load.

- Its save recorded checksums (common.pt: ``checksums``): without ``checksums.json`` it is refused in one
  line naming the file and --allow-missing-ckpt-checksums, by training, the conversions and evaluation's
  opening; with that flag it loads checked for size (a warning says so). Deleting the manifest used to turn
  the verification off, and the next save recorded sums of whatever was loaded.
- ``config.yaml`` is covered by ``checksums.json`` and compared with the arguments saved in the common state
  on every load: an edit after the save (``lr``, ``hidden_size``) is refused in one line naming the keys,
  with checksums or without (--no-ckpt-checksums). Training used to accept it without a word.

One tiny training run makes the checkpoints; the refusals are start-ups that stop before the model is built.
"""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.reliability.test_training_faults import tiny_args
from tests.training.test_pretrain import run_single

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run's root with complete checkpoints at 1 and 2 (checksums on), kept pristine: tests copy it."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    r = run_single(tiny_args(6, ["--save", str(ck), "--save-interval", "1", "--exit-interval", "2"]))
    assert r.returncode == 0, r.stderr[-3000:]
    return ck


def _copy(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    return ck, ck / "iter_0000002", ck / "iter_0000001"


def _errors(r):
    return [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]


def test_the_save_records_that_it_wrote_checksums_and_covers_config_yaml(saved):
    import json
    import zlib

    from megatron_lev.checkpoint import load_common

    it2 = saved / "iter_0000002"
    assert load_common(str(it2))["checksums"] is True
    entry = json.loads((it2 / "checksums.json").read_text())["files"]["config.yaml"]
    data = (it2 / "config.yaml").read_bytes()
    assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def test_a_deleted_manifest_is_refused_where_the_save_recorded_one(saved, tmp_path):
    from megatron_lev.checkpoint import CheckpointError, open_checkpoint
    from megatron_lev.conversion import ConversionError
    from megatron_lev.conversion import open_checkpoint as open_for_conversion

    ck, it2, it1 = _copy(saved, tmp_path)
    (it2 / "checksums.json").unlink()
    what = (f"{it2 / 'checksums.json'}: missing, though the save recorded checksums (its saved metadata says so): "
            "its files cannot be verified; pass --allow-missing-ckpt-checksums to load it checked for size only; "
            f"checkpoint {it2} cannot be loaded (nothing was loaded); the newest complete older checkpoint is {it1}: ")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(str(ck))
    assert str(e.value) == what + "pass --iteration 1", str(e.value)
    with pytest.raises(ConversionError, match="pass --allow-missing-ckpt-checksums"):
        open_for_conversion(str(ck))
    # Accepted once in this process (evaluation's ranks verified it together, with the flag): later opens
    # (its model's) do not refuse it again.
    from megatron_lev.checkpoint import files, mark_verified

    mark_verified(str(it2))
    open_checkpoint(str(ck))
    files._VERIFIED.clear()
    lines = []
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        open_for_conversion(str(ck), allow_missing_checksums=True)
    assert err.getvalue().splitlines() == [
        f"WARNING: {it2 / 'checksums.json'}: missing, though the save recorded checksums; its files are checked for "
        "size only (--allow-missing-ckpt-checksums)"], err.getvalue()
    assert lines == []

    # Training: refused at start-up (exit 2, one line); with the flag it resumes, says so, and its next save
    # records checksums of the state it chose to load.
    args = tiny_args(6, ["--save", str(ck), "--load", str(ck), "--save-interval", "1", "--exit-interval", "3"])
    r = run_single(args)
    assert r.returncode == 2 and _errors(r) == [f"error: {what}resume from it with --ckpt-step 1"], r.stderr[-3000:]
    assert not (ck / "iter_0000003").exists()
    r = run_single(args + ["--allow-missing-ckpt-checksums"])
    assert r.returncode == 0 and "at iteration 2" in r.stdout, r.stderr[-3000:]
    assert f"WARNING: {it2 / 'checksums.json'}: missing, though the save recorded checksums" in r.stdout
    assert (ck / "iter_0000003" / "checksums.json").exists()


def test_a_config_yaml_edited_after_the_save_is_refused_naming_the_keys(saved, tmp_path):
    from megatron_lev.checkpoint import CheckpointError, open_checkpoint
    from megatron_lev.conversion import ConversionError
    from megatron_lev.conversion import open_checkpoint as open_for_conversion

    ck, it2, _ = _copy(saved, tmp_path)
    cfg = it2 / "config.yaml"
    values = yaml.safe_load(cfg.read_text())
    assert values["lr"] == 0.001 and values["hidden_size"] == 32
    cfg.write_text(yaml.safe_dump(dict(values, lr=0.005, hidden_size=48), sort_keys=True))
    what = (f"{cfg}: differs from the arguments saved in the checkpoint in hidden_size (48 there, 32 saved), "
            "lr (0.005 there, 0.001 saved); config.yaml was edited after the save or belongs to another checkpoint: "
            "restore it (nothing was loaded)")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(str(ck))
    assert str(e.value) == what
    with pytest.raises(ConversionError) as e:
        open_for_conversion(str(ck))
    assert str(e.value) == what
    # Its checksum names the keys too (evaluation verifies the checksums before it opens the checkpoint).
    from megatron_lev.checkpoint import checksums
    from megatron_lev.checkpoint.files import describe_damage

    manifest = checksums.read_manifest(str(it2))
    found = checksums.first_damage(str(it2), manifest)
    assert describe_damage(str(it2), manifest, *found) == (
        str(cfg), "differs from the arguments saved in the checkpoint in hidden_size (48 there, 32 saved), lr (0.005 "
                  "there, 0.001 saved) (edited after the save)")
    # Training, with checksums and without.
    args = tiny_args(6, ["--save", str(ck), "--load", str(ck), "--save-interval", "1", "--exit-interval", "3"])
    for extra in ([], ["--no-ckpt-checksums"]):
        r = run_single(args + extra)
        assert r.returncode == 2 and _errors(r) == [f"error: {what}"], (extra, r.stderr[-3000:])
    assert not (ck / "iter_0000003").exists()
