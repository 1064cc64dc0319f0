"""Checkpoint errors a user can cause, found before anything is loaded or overwritten (no processes launched).

Errors that need a real checkpoint (a truncated shard, another model or tokenizer, another layout) are
tested on the reference run's checkpoints in test_checkpoint_resume.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ntl_pretrain.checkpoint import MANIFEST_NAME, CheckpointError, list_checkpoints, read_manifest, resolve_resume, step_of_tag
from ntl_pretrain.trainer.preemption import PreemptionHandler
from ntl_pretrain.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(120)


def _snapshot(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _fake_complete(folder, step: int) -> None:
    """A folder with a manifest whose listed files exist with their sizes (what a finished save leaves)."""
    tag = folder / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "shard.pt").write_bytes(b"x" * 100)
    (tag / MANIFEST_NAME).write_text(json.dumps({"step": step, "files": {"shard.pt": 100}}))


def test_missing_checkpoint_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match=r"train.resume='global_step3'.*the checkpoint directory.*does not exist"):
        resolve_resume(str(missing), "global_step3")
    assert resolve_resume(str(missing), "auto") is None  # a first start with resume=auto (e.g. a Slurm job)
    assert resolve_resume(str(missing), "none") is None
    assert not missing.exists()


def test_output_dir_that_is_a_file(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a folder")
    with pytest.raises(CheckpointError, match="is a file, not a folder"):
        resolve_resume(str(path), "auto")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads folders whatever their permissions")
def test_unreadable_checkpoint_directory(tmp_path):
    out = tmp_path / "run"
    _fake_complete(out, 5)
    os.chmod(out, 0)
    try:
        with pytest.raises(CheckpointError, match="is not readable"):
            resolve_resume(str(out), "auto")
    finally:
        os.chmod(out, 0o755)


def test_a_folder_with_another_runs_checkpoints_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "run"
    _fake_complete(out, 20)
    (out / "latest").write_text("global_step20")
    before = _snapshot(out)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints of another run \(global_step20\).*"
                                              r"train.resume=auto"):
        resolve_resume(str(out), "none")
    assert resolve_resume(str(out), "auto") == "global_step20"
    with pytest.raises(CheckpointError, match=r"no such checkpoint in .* \(found: \['global_step20'\]\)"):
        resolve_resume(str(out), "global_step7")
    with pytest.raises(CheckpointError, match="is not none, auto or a checkpoint tag"):
        resolve_resume(str(out), "step20")
    assert _snapshot(out) == before


def test_interrupted_saves_are_never_picked(tmp_path):
    out = tmp_path / "run"
    _fake_complete(out, 10)
    (out / "global_step20.partial").mkdir()  # a save killed before its rename
    (out / "global_step30").mkdir()  # a folder without a manifest (killed, or not ours)
    (out / "latest").write_text("global_step30")
    assert resolve_resume(str(out), "auto") == "global_step10"
    with pytest.raises(CheckpointError, match=r"global_step30' is incomplete: it has no ntl_checkpoint.json"):
        resolve_resume(str(out), "global_step30")
    assert [info.tag for info in list_checkpoints(str(out))] == ["global_step10"]
    only_partial = tmp_path / "partial_only"
    (only_partial / "global_step5").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"holds checkpoint folders \(global_step5\) but none is complete"):
        resolve_resume(str(only_partial), "auto")


def test_damaged_manifest_and_missing_or_truncated_files(tmp_path):
    out = tmp_path / "run"
    _fake_complete(out, 3)
    tag = out / "global_step3"
    (tag / "shard.pt").write_bytes(b"x" * 60)
    with pytest.raises(CheckpointError, match=r"shard.pt has 60 bytes, 100 were written \(a truncated shard\)"):
        resolve_resume(str(out), "global_step3")
    (tag / "shard.pt").unlink()
    with pytest.raises(CheckpointError, match="shard.pt is missing"):
        resolve_resume(str(out), "global_step3")
    (tag / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="damaged ntl_checkpoint.json"):
        read_manifest(str(tag))


def test_tag_names():
    assert step_of_tag("global_step300") == 300
    assert step_of_tag("global_step300.partial") is None
    assert step_of_tag("global_step300_universal") is None


def test_checkpoint_config_errors():
    base = ["model.architecture={model_type: llama}", "tokenizer.name_or_path=t", "data.sources=[{path: x.jsonl}]"]
    with pytest.raises(ConfigError, match="checkpoint.preempt_signals: 'SIGKILL' is not a catchable signal"):
        load_config(None, [*base, "checkpoint.preempt_signals=[SIGKILL]"])
    with pytest.raises(ConfigError, match="checkpoint.preempt_grace_s must be > 0"):
        load_config(None, [*base, "checkpoint.preempt_grace_s=0"])
    with pytest.raises(ConfigError, match="checkpoint.keep_last and checkpoint.keep_every_n_steps must be >= 0"):
        load_config(None, [*base, "checkpoint.keep_last=-1"])


def test_preemption_handler_records_the_signal_and_bounds_the_exit():
    handler = PreemptionHandler(["SIGUSR1"], grace_s=60)
    handler.install()
    handler.training_starts()  # before it a signal ends the process at once (test_lifecycle)
    try:
        assert handler.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not handler.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handler.requested() == "SIGUSR1"
        assert handler._watchdog is not None and handler._watchdog.is_alive()  # bounded by the grace time
    finally:
        handler.uninstall()
    assert not handler._watchdog.is_alive()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    with pytest.raises(CheckpointError, match="'SIGNOPE' is not a signal name"):
        PreemptionHandler(["SIGNOPE"], 10)


def test_preemption_grace_time_exceeded_ends_the_process():
    """A process that does not reach a step boundary in time exits (non-zero) when the grace time is over."""
    script = ("import os, signal, time\n"
              "from ntl_pretrain.trainer.preemption import PreemptionHandler\n"
              "h = PreemptionHandler(['SIGTERM'], grace_s=0.5); h.install(); h.training_starts()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(30)\n")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert time.monotonic() - started < 20
    assert "no checkpoint within checkpoint.preempt_grace_s=0.5 s of SIGTERM" in result.stderr


def _hashed_manifest(folder, step: int, files: dict[str, bytes], algorithm: str) -> None:
    """A complete checkpoint with sizes and content hashes computed here with the hash libraries themselves:
    manifest format 2 (sha256 entries, what earlier versions wrote) or 3 (xxh3_128, its algorithm named)."""
    import hashlib

    import xxhash

    tag = folder / f"global_step{step}"
    tag.mkdir(parents=True)
    for name, data in files.items():
        (tag / name).parent.mkdir(exist_ok=True)
        (tag / name).write_bytes(data)
    manifest = {"step": step, "files": {n: len(d) for n, d in files.items()}}
    if algorithm == "sha256":
        manifest.update(format=2, sha256={n: hashlib.sha256(d).hexdigest() for n, d in files.items()})
    else:
        manifest.update(format=3, hash_algorithm="xxh3_128",
                        hashes={n: xxhash.xxh3_128(d).hexdigest() for n, d in files.items()})
    (tag / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_content_hash_mismatch_skips_for_auto_and_is_an_error_for_the_tag(tmp_path, caplog, algorithm):
    """A same-size shard with other bytes is caught with today's hash (format 3) and with the sha256 of
    format-2 manifests, which still verify (global_step1 is resumed from)."""
    out = tmp_path / "run"
    _hashed_manifest(out, 1, {"shard.bin": b"a" * 5000, "hf/config.json": b"{}"}, algorithm)
    _hashed_manifest(out, 2, {"shard.bin": b"b" * 5000}, algorithm)
    (out / "global_step2" / "shard.bin").write_bytes(b"b" * 4000 + b"\x00" * 1000)  # same size, other bytes
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        assert resolve_resume(str(out), "auto") == "global_step1"
    assert "the content of shard.bin differs from what was written" in caplog.text
    assert "without content hashes" not in caplog.text
    with pytest.raises(CheckpointError, match=rf"global_step2' is damaged: the content of shard.bin differs from "
                                              rf"what was written \(its {algorithm} does not match"):
        resolve_resume(str(out), "global_step2")
    (out / "global_step1" / "shard.bin").write_bytes(b"c" * 5000)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* is intact"):
        resolve_resume(str(out), "auto")


def test_a_manifest_naming_an_unknown_hash_is_refused(tmp_path):
    out = tmp_path / "run"
    _hashed_manifest(out, 1, {"shard.bin": b"a" * 50}, "xxh3_128")
    manifest = json.loads((out / "global_step1" / MANIFEST_NAME).read_text())
    (out / "global_step1" / MANIFEST_NAME).write_text(json.dumps(dict(manifest, hash_algorithm="md7")))
    with pytest.raises(CheckpointError, match=r"names the content hash 'md7', which this version does not know"):
        resolve_resume(str(out), "global_step1")


def test_a_manifest_without_hashes_is_checked_by_size_with_a_warning(tmp_path, caplog):
    out = tmp_path / "run"
    _fake_complete(out, 4)  # format 1: sizes only
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        assert resolve_resume(str(out), "auto") == "global_step4"
    assert "without content hashes" in caplog.text and "only file sizes are checked" in caplog.text


def test_cleanup_and_staging_touch_only_folders_marked_as_ours(tmp_path):
    from ntl_pretrain.checkpoint import make_staging, remove_interrupted_saves, remove_staging

    out = tmp_path / "run"
    (out / "mydata.partial").mkdir(parents=True)
    (out / "global_step3.partial").mkdir()  # our naming pattern, but no marker: not ours
    (out / "old.replaced").write_text("x")
    make_staging(str(out / "global_step4.partial"))
    make_staging(str(out / "global_step2"))  # a re-save of step 2 committed; the old copy still aside
    make_staging(str(out / "global_step2.replaced"))
    make_staging(str(out / "global_step5.replaced"))  # killed between the two renames: the only step 5
    (out / "global_step5.replaced" / "model_states.pt").write_text("old")
    make_staging(str(out / "global_step2_universal.partial"))
    make_staging(str(out / "notes.partial"))  # marked, but not our naming pattern
    make_staging(str(out / "notes.replaced"))
    assert remove_interrupted_saves(str(out)) == ["global_step2.replaced", "global_step2_universal.partial",
                                                  "global_step4.partial"]
    assert sorted(p.name for p in out.iterdir()) == ["global_step2", "global_step3.partial", "global_step5",
                                                     "mydata.partial", "notes.partial", "notes.replaced",
                                                     "old.replaced"]
    assert (out / "global_step5" / "model_states.pt").read_text() == "old"
    with pytest.raises(CheckpointError, match=r"mydata.partial' exists but was not made by ntl_pretrain"):
        remove_staging(str(out / "mydata.partial"))
    assert (out / "mydata.partial").is_dir()


def test_errors_of_checkpoint_work_on_main_are_agreed_checkpoint_errors():
    """One primitive agrees on errors (`distributed.run_agreed`); the checkpoint's kind stays a CheckpointError
    (exit 2 in the trainer) and is an AgreedError (printed once, by global rank 0)."""
    from ntl_pretrain.checkpoint import AgreedCheckpointError, run_on_main
    from ntl_pretrain.core.agreement import AgreedError

    def fails(error: Exception):
        def fn():
            raise error
        return fn

    with pytest.raises(AgreedCheckpointError, match=r"^checkpoint 'x' is damaged$") as caught:
        run_on_main(True, fails(CheckpointError("checkpoint 'x' is damaged")))
    assert isinstance(caught.value, CheckpointError) and isinstance(caught.value, AgreedError)
    with pytest.raises(AgreedCheckpointError, match=r"^OSError: \[Errno 28\] No space left on device$"):
        run_on_main(True, fails(OSError(28, "No space left on device")))
    assert run_on_main(False, fails(OSError(28, "never run"))) is None  # not the main rank: nothing runs
    assert run_on_main(True, lambda: 7) == 7


# ------------------------------------------------------------------ issue 23: names, links, schema, folder names
def _manager(out, keep_last: int):
    from ntl_pretrain.checkpoint import CheckpointManager
    from ntl_pretrain.config.schema import CheckpointConfig
    from ntl_pretrain.parallel.layout import ParallelLayout

    layout = ParallelLayout(world_size=1, rank=0, local_rank=0, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0)
    return CheckpointManager(CheckpointConfig(keep_last=keep_last), str(out), layout, 1, {}, seed=0)


def _write_manifest(tag, **changes) -> None:
    manifest = json.loads((tag / MANIFEST_NAME).read_text())
    manifest.update(changes)
    (tag / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../secret.bin", "/SECRET", "hf/../../secret.bin", "./shard.bin", "hf//x"])
def test_manifest_names_outside_the_checkpoint_are_refused_before_anything_is_read(tmp_path, name):
    """No size, hash or pickle scan of a file outside the folder, and no error telling anything about it."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 4321)
    out = tmp_path / "run"
    _hashed_manifest(out, 1, {"shard.bin": b"a" * 10}, "xxh3_128")
    tag = out / "global_step1"
    target = str(secret) if name == "/SECRET" else name
    _write_manifest(tag, files={"shard.bin": 10, target: 1}, hashes={"shard.bin": "0", target: "0"})
    with pytest.raises(CheckpointError, match=r"ntl_checkpoint.json lists .*, which is not a plain relative path "
                                              r"inside the checkpoint") as caught:
        resolve_resume(str(out), "global_step1")
    assert "4321" not in str(caught.value) and "\n" not in str(caught.value)


def test_links_unlisted_files_and_folders_in_a_checkpoint_are_refused_by_name(tmp_path, caplog):
    """Verification (resume, conversion, export) passes only a folder holding exactly its manifest's files."""
    from ntl_pretrain.checkpoint import verify_checkpoint

    secret = tmp_path / "id_rsa"
    secret.write_bytes(b"PRIVATE KEY")
    out = tmp_path / "run"
    _hashed_manifest(out, 1, {"shard.bin": b"a" * 10}, "xxh3_128")
    _hashed_manifest(out, 2, {"shard.bin": b"b" * 10, "hf/config.json": b"{}", "hf/tokenizer.json": b"PRIVATE KEY"},
                     "xxh3_128")
    tag = out / "global_step2"
    (tag / "KEEP").write_text("")  # made by hand after the save: allowed
    assert verify_checkpoint(str(tag))["step"] == 2
    (tag / "hf" / "tokenizer.json").unlink()
    (tag / "hf" / "tokenizer.json").symlink_to(secret)  # same size and hash as listed, as an attacker would
    with pytest.raises(CheckpointError, match=r"global_step2': hf/tokenizer.json is a symbolic link; .* links are "
                                              r"never followed"):
        verify_checkpoint(str(tag))
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        assert resolve_resume(str(out), "auto") == "global_step1"
    assert "hf/tokenizer.json is a symbolic link" in caplog.text
    (tag / "hf" / "tokenizer.json").unlink()
    (tag / "hf" / "tokenizer.json").write_bytes(b"PRIVATE KEY")
    (tag / "hf" / "extra").mkdir()
    with pytest.raises(CheckpointError, match=r"hf/extra is a folder; hf/ holds the model's config and tokenizer files "
                                              r"only"):
        verify_checkpoint(str(tag))
    (tag / "hf" / "extra").rmdir()
    (tag / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"global_step2' holds notes.txt, which its manifest does not list"):
        verify_checkpoint(str(tag))
    (tag / "notes.txt").unlink()
    (tag / "zero").mkdir()
    with pytest.raises(CheckpointError, match=r"holds the folder zero, which its manifest does not list"):
        verify_checkpoint(str(tag))
    (tag / "zero").rmdir()
    os.mkfifo(tag / "pipe")
    listed = json.loads((tag / MANIFEST_NAME).read_text())
    _write_manifest(tag, files={**listed["files"], "pipe": 0}, hashes={**listed["hashes"], "pipe": "0"})
    with pytest.raises(CheckpointError, match=r"pipe is not a regular file"):
        verify_checkpoint(str(tag), content=False)
    (tag / "pipe").unlink()
    (tag / MANIFEST_NAME).rename(tmp_path / "manifest.json")
    (tag / MANIFEST_NAME).symlink_to(tmp_path / "manifest.json")
    with pytest.raises(CheckpointError, match=r"its ntl_checkpoint.json is a symbolic link, which is never followed"):
        verify_checkpoint(str(tag))


def test_a_linked_checkpoint_is_never_followed_and_never_crashes_keep_last(tmp_path, caplog):
    other = tmp_path / "other_run"
    _fake_complete(other, 9)
    out = tmp_path / "run"
    _fake_complete(out, 1)
    _fake_complete(out, 2)
    (out / "global_step9").symlink_to(other / "global_step9")
    (out / "latest").symlink_to(tmp_path / "secret")
    (tmp_path / "secret").write_text("top secret")
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        assert resolve_resume(str(out), "auto") == "global_step2"
    assert "global_step9: it is a symbolic link, and checkpoints are never followed out of the run folder" in caplog.text
    assert "top secret" not in caplog.text  # `latest` is not read through a link either
    with pytest.raises(CheckpointError, match=r"train.resume='global_step9': .* is a symbolic link"):
        resolve_resume(str(out), "global_step9")
    assert _manager(out, keep_last=1).prune() == ["global_step1"]
    assert (out / "global_step9").is_symlink() and (other / "global_step9" / "shard.pt").is_file()


def test_a_folder_named_for_another_step_than_its_manifest_is_skipped(tmp_path, caplog):
    out = tmp_path / "run"
    _fake_complete(out, 2)
    _fake_complete(out, 4)
    shutil.copytree(out / "global_step2", out / "global_step9")  # a copy of step 2, misnamed
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        assert resolve_resume(str(out), "auto") == "global_step4"
    assert "global_step9' is named for step 9 but its manifest says step 2" in caplog.text
    with pytest.raises(CheckpointError, match=r"named for step 9 but its manifest says step 2 .* rename it "
                                              r"global_step2 or remove it"):
        resolve_resume(str(out), "global_step9")
    assert _manager(out, keep_last=1).prune() == ["global_step2"]  # never on the strength of the misnamed folder
    assert (out / "global_step4").is_dir() and (out / "global_step9").is_dir()


@pytest.mark.parametrize("changes, message", [
    ({"format": 99}, r"has format 99, which this version does not know \(1, 2, 3\)"),
    ({"format": "3"}, r"has format '3', which this version does not know"),
    ({"files": {}}, r"'files' is empty, not the mapping of the checkpoint's files to their sizes"),
    ({"files": ["shard.bin"]}, r"'files' is a list, not the mapping"),
    ({"files": "shard.bin"}, r"'files' is a string, not the mapping"),
    ({"files": {"shard.bin": "10"}}, r"the size of shard.bin is '10', not a number of bytes"),
    ({"step": "2"}, r"'step' is '2', not a step number"),
    ({"hashes": ["x"]}, r"'hashes' is a list, not a mapping"),
    ({"hashes": {}}, r"is of format 3 but does not record a content hash for each file"),
    ({"fingerprint": "x"}, r"'fingerprint' is a string, not a mapping"),
    ({"layout": [1, 1, 1, 0]}, r"'layout' is a list, not a mapping"),
    ({"layout": {"world_size": 1}}, r"'layout' is \{'world_size': 1\}, not \{world_size, dp_size, tp_size, zero_stage"),
    ({"data": []}, r"'data' is a list, not a mapping or null"),
    ({"layout": {"world_size": 2, "dp_size": 1, "tp_size": 0, "zero_stage": 3}},
     r"'layout' has tp_size=0, not a number of processes \(1 or more\)"),
])
def test_a_manifest_of_the_wrong_shape_or_version_is_refused_in_one_line(tmp_path, changes, message):
    out = tmp_path / "run"
    _hashed_manifest(out, 2, {"shard.bin": b"a" * 10}, "xxh3_128")
    _write_manifest(out / "global_step2", **changes)
    with pytest.raises(CheckpointError, match=message) as caught:
        resolve_resume(str(out), "global_step2")
    assert "\n" not in str(caught.value)


def test_a_manifest_with_a_key_twice_is_refused(tmp_path):
    out = tmp_path / "run"
    _hashed_manifest(out, 2, {"shard.bin": b"a" * 10}, "xxh3_128")
    text = (out / "global_step2" / MANIFEST_NAME).read_text()
    (out / "global_step2" / MANIFEST_NAME).write_text(text[:-1] + ', "files": {"shard.bin": 10}}')
    with pytest.raises(CheckpointError, match=r"damaged ntl_checkpoint.json: the key 'files' appears twice"):
        read_manifest(str(out / "global_step2"))


class _FileWritingEngine:
    """What DeepSpeed's save leaves for one rank: its files in the tag's folder."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        import torch

        torch.save({"module": torch.ones(3), "client": client_state}, os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))
        # ZeRO-1 (the manager's zero_stage): the rank's optimizer partition too, which verification expects
        torch.save({"optimizer_state_dict": {}}, os.path.join(save_dir, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))


def test_a_committed_checkpoint_keeps_no_staging_marker(tmp_path):
    """A save (the manager's own, with a stand-in for DeepSpeed's file writing) commits a folder without the
    `.ntl_staging` marker, which only interrupted saves carry; a re-save of the same step leaves nothing aside."""
    from ntl_pretrain.checkpoint import remove_interrupted_saves, verify_checkpoint

    out = tmp_path / "run"
    out.mkdir()  # made with the run lock at start
    manager = _manager(out, keep_last=0)

    def write_hf(folder):
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as handle:
            handle.write("{}")

    for _ in range(2):  # the second: the same step saved again
        assert manager.save(_FileWritingEngine(), 3, {"tokens_seen": 7}, write_hf) == "global_step3"
        tag = out / "global_step3"
        assert not (tag / ".ntl_staging").exists()
        assert ".ntl_staging" not in json.loads((tag / MANIFEST_NAME).read_text())["files"]
        assert verify_checkpoint(str(tag))["step"] == 3
        assert sorted(p.name for p in out.iterdir() if p.name.startswith("global_step")) == ["global_step3"]
    assert remove_interrupted_saves(str(out)) == [] and tag.is_dir()


class _DiskFullEngine:
    """DeepSpeed's save on a full disk: torch's zip writer reports the failed write as "unexpected pos"."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        import torch

        torch.save({"module": torch.ones(1000)}, "/dev/full")  # every write: ENOSPC


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_during_a_save_is_named_with_the_space_left(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    manager = _manager(out, keep_last=0)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100 << 20))
    with pytest.raises(CheckpointError, match=rf"^saving checkpoint global_step3 failed on rank 0: no space left on "
                                              rf"{str(out)!r} \(0.10 GiB free\); no previous checkpoint exists") as caught:
        manager.save(_DiskFullEngine(), 3, {}, lambda folder: os.makedirs(folder))
    assert "\n" not in str(caught.value) and not (out / "global_step3").exists()


def test_a_run_folder_deleted_while_training_is_not_silently_recreated_by_a_save(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    manager = _manager(out, keep_last=0)
    out.rmdir()  # `rm -rf` of the run folder while the run trains
    with pytest.raises(CheckpointError, match=r"^cannot save a checkpoint: train.output_dir=.* was deleted or moved "
                                              r"while this run was training .* nothing was saved"):
        manager.save(_FileWritingEngine(), 3, {}, lambda folder: os.makedirs(folder))
    assert not out.exists()


def test_data_keys_newer_than_a_checkpoint_do_not_refuse_its_resume_at_their_defaults():
    """A checkpoint written before data.sources.*.format / prompt_template and data.max_document_chars
    existed records the source keys of that time: at their defaults the new keys are left out of the
    description, so it still matches; set, they are recorded and a change is named."""
    from ntl_pretrain.data import data_description
    from ntl_pretrain.checkpoint.fingerprint import describe_changes
    from ntl_pretrain.config import load_config

    keys_of_the_first_checkpoints = {"path", "name", "split", "text_field", "prompt_field", "completion_field",
                                     "weight", "streaming", "generate_arithmetic", "generate_options"}
    demo = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    cfg = load_config(demo, [])
    described = data_description(cfg.data)
    assert {k for k in described["sources"][0] if k != "files"} == keys_of_the_first_checkpoints
    assert "max_document_chars" not in described
    changed = load_config(demo, ["data.max_document_chars=1000"])
    assert "data.max_document_chars: null -> 1000" in describe_changes(described, data_description(changed.data), "data")


def _torch_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _tp2_checkpoint(run, step: int, drop_tp_rank: int | None = None) -> Path:
    """A checkpoint of layout world 2 = dp 1 x tp 2, ZeRO-3 (the files DeepSpeed names), its manifest re-signed
    without the files of `drop_tp_rank` (as if they were deleted and the manifest written again)."""
    files = {f"zero_pp_rank_0_mp_rank_{tp:02d}_{kind}_states.pt": _torch_bytes({"x": torch.ones(2)})
             for tp in range(2) for kind in ("model", "optim") if tp != drop_tp_rank}
    _hashed_manifest(run, step, files, "xxh3_128")
    manifest_path = run / f"global_step{step}" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["layout"] = {"world_size": 2, "dp_size": 1, "tp_size": 2, "zero_stage": 3, "sp_size": 1}
    manifest_path.write_text(json.dumps(manifest))
    return run / f"global_step{step}"


def test_a_tensor_parallel_ranks_files_missing_from_a_resigned_manifest_are_named(tmp_path):
    """Issue 40 item 11: export said "lm_head.weight has shape (256, 128), the model expects (512, 128)", resume
    died in DeepSpeed's `AssertionError: checkpoint count 1 is different from saved mp_world_size 2`."""
    from ntl_pretrain.checkpoint import export_hf
    from ntl_pretrain.checkpoint.integrity import verify_checkpoint
    from ntl_pretrain.checkpoint.universal import convert_to_universal

    run = tmp_path / "run"
    verify_checkpoint(str(_tp2_checkpoint(run, 1)))  # the whole layout: fine
    broken = _tp2_checkpoint(run, 2, drop_tp_rank=1)
    message = (r"lacks 1 model-states file\(s\) of its layout \(world 2 = dp 1 x tp 2, ZeRO-3\): those of "
               r"\(tensor-parallel rank, ZeRO partition\) \[\(1, 0\)\], e.g. zero_pp_rank_0_mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match=message):
        resolve_resume(str(run), "global_step2")
    with pytest.raises(CheckpointError, match=message):
        export_hf(str(broken), str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=message):
        convert_to_universal(str(broken))
    assert not (tmp_path / "hf").exists() and not (run / "global_step2_universal").exists()


def test_an_export_into_another_checkpoint_of_the_run_is_refused(tmp_path):
    """Issue 40 item 4: `export_hf.py RUN/global_step2 RUN/global_step1/exported` succeeded, after which
    global_step1 failed verification and could no longer be resumed or exported."""
    from ntl_pretrain.checkpoint import export_hf
    from ntl_pretrain.checkpoint.integrity import verify_checkpoint
    from ntl_pretrain.checkpoint.universal import convert_to_universal

    run = tmp_path / "run"
    first, second = _tp2_checkpoint(run, 1), _tp2_checkpoint(run, 2)
    before = _snapshot(run)
    for inside in (first / "exported", first / "hf" / "deeper"):
        with pytest.raises(CheckpointError, match=rf"export folder .* is inside the checkpoint '{first}'"):
            export_hf(str(second), str(inside))
        with pytest.raises(CheckpointError, match=rf"universal folder .* is inside the checkpoint '{first}'"):
            convert_to_universal(str(second), str(inside))
    assert _snapshot(run) == before
    verify_checkpoint(str(first))
    assert [info.tag for info in list_checkpoints(str(run))] == ["global_step1", "global_step2"]


def test_a_checkpoint_path_that_is_a_link_is_named_as_one(tmp_path, capsys):
    """Issue 40 item 10: export said "holds no complete checkpoint", reshard "restore the checkpoint's hf/
    folder"; both now say the path is a link, which is never followed, and name the real folder."""
    import runpy

    from ntl_pretrain.checkpoint import export_hf
    from ntl_pretrain.checkpoint.universal import convert_to_universal

    real = _tp2_checkpoint(tmp_path / "run", 1)
    (tmp_path / "linked_step").symlink_to(real)
    (tmp_path / "run_link").symlink_to(tmp_path / "run")
    message = rf"is a symbolic link \(to '{real}'\), which is never followed; pass the real folder"
    with pytest.raises(CheckpointError, match=message):
        export_hf(str(tmp_path / "linked_step"), str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=message):
        convert_to_universal(str(tmp_path / "linked_step"))
    repo = Path(__file__).resolve().parents[1]
    for tool, args in (("export_hf.py", [str(tmp_path / "linked_step"), str(tmp_path / "hf")]),
                       ("export_hf.py", [str(tmp_path / "run_link"), str(tmp_path / "hf")]),
                       ("reshard.py", [str(tmp_path / "linked_step")])):
        assert runpy.run_path(str(repo / "tools" / tool))["main"](args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is a symbolic link (to " in err and "never followed" in err, err
    assert not (tmp_path / "hf").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "linked_step", "run", "run_link"]


def test_an_export_or_universal_folder_that_is_a_link_is_refused_before_the_work(tmp_path):
    """A dangling link (or one to an empty folder) as the export's OUT failed only at the final rename, after the
    whole export, with `[Errno 20] Not a directory` naming OUT.partial."""
    from ntl_pretrain.checkpoint import export, export_hf
    from ntl_pretrain.checkpoint.universal import convert_to_universal

    checkpoint = _tp2_checkpoint(tmp_path / "run", 1)
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "nowhere", tmp_path / "empty"):
        (tmp_path / "out").unlink(missing_ok=True)
        (tmp_path / "out").symlink_to(target)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(export, "verify_checkpoint", lambda path: pytest.fail("the checkpoint was read first"))
            with pytest.raises(CheckpointError, match=rf"export folder '{tmp_path / 'out'}' is a symbolic link \(to "
                                                      rf"'{target}'\), which is never written through"):
                export_hf(str(checkpoint), str(tmp_path / "out"))
        with pytest.raises(CheckpointError, match=r"universal folder .* is a symbolic link"):
            convert_to_universal(str(checkpoint), str(tmp_path / "out"))
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_manifest_edited_to_a_smaller_layout_over_more_rank_files_is_refused(tmp_path):
    """Issue 40 defect 2: a manifest re-signed to say tp 1 over a checkpoint holding tp-2 files exported rank 0's
    half of every sharded weight; export, reshard and resume now name the files the layout has no rank for.
    A layout whose sizes do not multiply to its world size is refused too."""
    import xxhash

    from ntl_pretrain.checkpoint import export_hf
    from ntl_pretrain.checkpoint.universal import convert_to_universal

    run = tmp_path / "run"
    edited = _tp2_checkpoint(run, 2)
    (edited / "rng_state_1.pt").write_bytes(_torch_bytes({"x": torch.ones(1)}))
    manifest = json.loads((edited / MANIFEST_NAME).read_text())
    manifest["files"]["rng_state_1.pt"] = (edited / "rng_state_1.pt").stat().st_size
    manifest["hashes"]["rng_state_1.pt"] = xxhash.xxh3_128((edited / "rng_state_1.pt").read_bytes()).hexdigest()
    manifest["layout"].update(world_size=1, tp_size=1)
    (edited / MANIFEST_NAME).write_text(json.dumps(manifest))
    message = (r"holds 3 file\(s\) its layout \(world 1 = dp 1 x tp 1, ZeRO-3\) has no rank for: rng_state_1.pt, "
               r"zero_pp_rank_0_mp_rank_01_model_states.pt, zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with pytest.raises(CheckpointError, match=message):
        resolve_resume(str(run), "global_step2")
    with pytest.raises(CheckpointError, match=message):
        export_hf(str(edited), str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=message):
        convert_to_universal(str(edited))
    manifest["layout"].update(world_size=2)  # tp 1 x dp 1 is one process, not 2
    (edited / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"manifest's layout is inconsistent \(world 2 = dp 1 x tp 1, ZeRO-3: "
                                              r"1 processes, not 2\)"):
        export_hf(str(edited), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists() and not (run / "global_step2_universal").exists()


def test_a_zero_stage_beyond_3_and_an_export_path_that_is_a_file_are_named_as_such(tmp_path):
    """Issue 40, go-beyond round: zero_stage 7 in a re-signed manifest was reported as files "its layout has no rank
    for"; an export path that is a file was "already exists and is not empty"."""
    from ntl_pretrain.checkpoint import export_hf

    run = tmp_path / "run"
    good = _tp2_checkpoint(run, 1)
    a_file = tmp_path / "model.safetensors"
    a_file.write_text("mine")
    with pytest.raises(CheckpointError, match=r"export folder .*model.safetensors' is a file, not a folder"):
        export_hf(str(good), str(a_file))
    assert a_file.read_text() == "mine"
    manifest = json.loads((good / MANIFEST_NAME).read_text())
    manifest["layout"]["zero_stage"] = 7
    (good / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"'layout' has zero_stage=7, not a ZeRO stage \(0-3\)"):
        resolve_resume(str(run), "global_step1")


def test_reshard_of_a_run_folder_names_its_checkpoints(tmp_path, capsys):
    """Issue 40, go-beyond round: `tools/reshard.py RUN` said the run folder "is incomplete: it has no
    ntl_checkpoint.json (its save was interrupted ...)"; it now says it is a run folder and names a checkpoint."""
    import runpy

    run = tmp_path / "run"
    _tp2_checkpoint(run, 1), _tp2_checkpoint(run, 2)
    before = _snapshot(run)
    main = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "reshard.py"))["main"]
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {str(run)!r} is a run folder, not a checkpoint; pass one of its checkpoints, e.g. "
                   f"{run / 'global_step2'} (complete: global_step1, global_step2)\n")
    assert _snapshot(run) == before



@pytest.mark.fast
@pytest.mark.parametrize("seed", [0, 1234, 2**63 - 1])  # the range train.seed allows; NumPy's legacy seed is 32 bits
def test_the_runs_seed_fixes_every_generator_a_checkpoint_saves(seed):
    """Start-up seeds Python's, NumPy's and torch's generators from train.seed (checkpoint.seed_generators), so a
    checkpoint's rng_state_<rank>.pt is the same for two runs with the same seed whatever state the process had:
    each generator drawn from after the seeding, the saved state as the checkpoint writes it (torch.save bytes)."""
    import random

    import numpy as np

    from ntl_pretrain.checkpoint import seed_generators
    from ntl_pretrain.checkpoint.safe_loading import rng_state

    def seeded_run() -> tuple[tuple, bytes]:
        random.seed(os.urandom(8))  # another process's state before start-up
        np.random.seed(int.from_bytes(os.urandom(4), "little"))
        torch.seed()
        seed_generators(seed)
        draws = (random.random(), float(np.random.random()), float(torch.rand(1)))
        buffer = io.BytesIO()
        torch.save(rng_state(), buffer)
        return draws, buffer.getvalue()

    first = seeded_run()
    assert seeded_run() == first
    seed_generators(seed ^ 1)
    assert random.random() != first[0][0] and float(np.random.random()) != first[0][1]  # another seed, another sequence


def test_a_latest_pointer_that_is_no_file_is_named_not_replaced(tmp_path):
    """Issue 47 item 1 on the run folder: `latest` made a fifo (or a link to /dev/null) while the run trained was
    replaced by a file through the shared writer; it is left as it is and the save says so in one line."""
    out = tmp_path / "run"
    out.mkdir()
    manager = _manager(out, keep_last=0)
    os.mkfifo(out / "latest")
    with pytest.raises(CheckpointError) as caught:
        manager.save(_FileWritingEngine(), 3, {}, lambda folder: os.makedirs(folder))
    assert str(caught.value) == (f"checkpoint global_step3 is saved, but {str(out / 'latest')!r} is not a regular "
                                 f"file, so it was left as it is and does not name global_step3: remove it (the next "
                                 f"save writes it), or resume with train.resume=global_step3")
    assert stat.S_ISFIFO(os.stat(out / "latest").st_mode) and (out / "global_step3").is_dir()
