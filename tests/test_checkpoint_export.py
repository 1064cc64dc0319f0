"""Export of every checkpoint layout to a Hugging Face folder (issue 12 item 0): the trained model's logits
from `from_pretrained` equal the engine's (gathered over the tensor-parallel shards).

DeepSpeed's universal form stores `zero/<name>/fp32.pt` as a bare flat tensor for ZeRO-3 without tensor
parallelism and needs injected metadata for ZeRO 1/2 without it; each layout below trains 2 steps on 2
CPU processes with `checkpoint.export_hf_at_end=true` (the trainer's export), and two are also exported
with `tools/export_hf.py`. T=2 with ZeRO-3 and untied embeddings is covered by test_checkpoint_resume.py.
The tests after them use the same checkpoints in one process: the export against DeepSpeed's conversion,
a kill -9 during it, links planted in hf/, a full disk (issues 23 and 24).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from helpers.launch import DEMO, demo_overrides, run, run_ok

TIMEOUT = 400
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(6 * TIMEOUT)]  # the fixture: 2 launches, 5 runs

LAYOUTS = {  # name: (tp_size, zero_stage, tie_word_embeddings)
    "t1_zero1_untied": (1, 1, False),
    "t1_zero2_tied": (1, 2, True),
    "t1_zero3_untied": (1, 3, False),
    "t1_zero3_tied": (1, 3, True),
    "t2_zero1_tied": (2, 1, True),
}


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory) -> Path:
    """Every layout trained 2 steps on 2 processes with the export at the end; each run's folder and the trained
    engine's logits on a fixed text (`<name>_logits.pt`). One launch per tp_size, its runs one after the other."""
    root = tmp_path_factory.mktemp("export")
    for tp in sorted({tp for tp, _, _ in LAYOUTS.values()}):
        args: list[str] = []
        for name, (layout_tp, zero, tied) in LAYOUTS.items():
            if layout_tp == tp:
                args += ["--"] * bool(args) + [str(root / f"{name}_logits.pt"), DEMO, *demo_overrides(
                    assets, root / name, "train.max_steps=2", f"parallel.tp_size={tp}", f"parallel.zero_stage={zero}",
                    f"data.micro_batch_size={8 // (2 // tp)}", f"model.architecture.tie_word_embeddings={str(tied).lower()}",
                    "checkpoint.export_hf_at_end=true")]
        run_workers("checkpoint_resume_logits.py", 2, args, timeout=TIMEOUT + 200 * args.count("--"))
    return root


def _assert_same_logits(export: Path, reference: dict, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.tie_word_embeddings is tied
    if tied:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_of_every_layout_reloads_with_the_engines_logits(name, trained, tmp_path):
    _, _, tied = LAYOUTS[name]
    out, reference = trained / name, torch.load(trained / f"{name}_logits.pt")
    assert reference["step"] == 2
    _assert_same_logits(out / "hf_export", reference, tied)  # checkpoint.export_hf_at_end
    # the command-line tool on the same checkpoint: once, on ZeRO-3 with tied weights (the tool calls the export the
    # trainer's export_hf_at_end calls, checked above for every layout; a second layout ran the same code again)
    if name == "t1_zero3_tied":
        export = tmp_path / "hf"
        run_ok([sys.executable, "tools/export_hf.py", str(out), str(export)], timeout=TIMEOUT)
        _assert_same_logits(export, reference, tied)


# --- the export reads the weights only, leaves nothing behind, copies no links, says when the disk is full ---

def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: tensor for shard in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(shard).items()}


@pytest.mark.parametrize("name", ["t1_zero1_untied", "t1_zero3_tied", "t2_zero1_tied"])
def test_export_equals_deepspeeds_conversion_without_converting(name, trained, tmp_path, monkeypatch):
    """Every exported tensor equals DeepSpeed's universal conversion of the checkpoint (the reference), while
    the export itself runs none of the conversion's steps that write fragment files (they are made to fail)."""
    from deepspeed.checkpoint import ds_to_universal

    from ntl_pretrain.checkpoint import convert_to_universal, export_hf
    from ntl_pretrain.checkpoint.format import STAGING_MARKER

    checkpoint = trained / name / "global_step2"
    universal = Path(convert_to_universal(str(checkpoint), str(tmp_path / "reference" / "universal")))
    assert not (universal / STAGING_MARKER).exists()  # committed: never to be taken for an interrupted conversion

    def no_conversion(*args, **kwargs):
        raise AssertionError("the export ran a step of the universal conversion")

    for step in ("main", "extract_zero_shards", "extract_zero_shards_stage3", "dump_param_fragment"):
        monkeypatch.setattr(ds_to_universal, step, no_conversion)
    export_hf(str(checkpoint), str(tmp_path / "hf"), max_shard_size="200KB")  # several shards
    exported = _tensors(tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["hf", "reference"]  # no scratch beside it
    for key, tensor in exported.items():
        stored = torch.load(universal / "zero" / key / "fp32.pt", weights_only=False)
        reference = stored["param"] if isinstance(stored, dict) else stored
        assert torch.equal(tensor, reference.reshape(tensor.shape)), key
    assert set(exported) == {entry.name for entry in (universal / "zero").iterdir() if entry.is_dir()} - (
        {"lm_head.weight"} if LAYOUTS[name][2] else set())
    assert _tensors(trained / name / "hf_export").keys() == exported.keys()


KILL_AT_FIRST_FSYNC_IN = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
staging = os.path.abspath(sys.argv[2]) + ".partial"
fsync = os.fsync
def fsync_then_die(fd):
    fsync(fd)
    if os.readlink(f"/proc/self/fd/{fd}").startswith(staging):  # the export has begun writing its output
        os.kill(os.getpid(), signal.SIGKILL)
os.fsync = fsync_then_die
from ntl_pretrain.checkpoint import export_hf
export_hf(sys.argv[1], sys.argv[2], max_shard_size="200KB")
"""


def test_killed_export_leaves_nothing_a_rerun_does_not_remove(trained, tmp_path):
    """kill -9 in the middle of writing the export (at its first fsync inside OUT.partial), then the same
    export again: it succeeds, and the folder holds the export and nothing else (no scratch left for good)."""
    checkpoint, out = trained / "t1_zero3_untied" / "global_step2", tmp_path / "exports" / "hf"
    killed = run([sys.executable, "-c", KILL_AT_FIRST_FSYNC_IN, str(checkpoint), str(out)], timeout=TIMEOUT)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (tmp_path / "exports" / "hf.partial").is_dir() and not out.exists()
    run_ok([sys.executable, "tools/export_hf.py", str(checkpoint), str(out)], timeout=TIMEOUT)
    assert sorted(entry.name for entry in (tmp_path / "exports").iterdir()) == ["hf"]
    reference = _tensors(trained / "t1_zero3_untied" / "hf_export")
    exported = _tensors(out)
    assert reference.keys() == exported.keys() and all(torch.equal(reference[k], exported[k]) for k in reference)


def test_links_and_folders_in_hf_are_never_copied(trained, tmp_path):
    """A symbolic link planted in a checkpoint's hf/ folder (to a secret outside it) and a sub-folder: the
    export and the universal conversion either refuse the checkpoint or copy neither, and the secret's bytes
    are nowhere in what they write."""
    import shutil

    checkpoint = tmp_path / "run" / "global_step2"
    shutil.copytree(trained / "t1_zero1_untied" / "global_step2", checkpoint)
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY 0123456789")
    (checkpoint / "hf" / "id_rsa").symlink_to(secret)
    (checkpoint / "hf" / "sub").mkdir()
    (checkpoint / "hf" / "sub" / "x.json").write_text("{}")
    export = run([sys.executable, "tools/export_hf.py", str(checkpoint), str(tmp_path / "hf")], timeout=TIMEOUT)
    reshard = run([sys.executable, "tools/reshard.py", str(checkpoint), "--output", str(tmp_path / "universal")],
                  timeout=TIMEOUT)
    for result, folder in ((export, tmp_path / "hf"), (reshard, tmp_path / "universal")):
        assert result.returncode in (0, 2), result.stderr[-3000:]
        written = [path for path in folder.rglob("*")] if folder.exists() else []
        assert (result.returncode == 0) == bool(written), result.stderr[-3000:]
        assert not any(path.is_symlink() or path.name in ("id_rsa", "sub") for path in written)
        assert not any(path.is_file() and b"PRIVATE KEY" in path.read_bytes() for path in written)


def test_bad_shard_sizes_and_a_folder_inside_the_checkpoint_are_refused_before_it_is_read(trained, tmp_path,
                                                                                         monkeypatch):
    """huggingface_hub takes "0GB" and "-5GB" (every tensor in a file of its own) and refuses "1000000" (bytes, as
    the docs allow); an export (or a universal conversion) into the checkpoint folder succeeded and left the
    checkpoint refused by verification (the run could not resume). Each is one line before anything is hashed; a
    plain byte count works."""
    import shutil

    from ntl_pretrain.checkpoint import CheckpointError, export, list_checkpoints, universal

    run_dir = tmp_path / "run"
    checkpoint = run_dir / "global_step2"
    shutil.copytree(trained / "t1_zero1_untied" / "global_step2", checkpoint)
    verify = export.verify_checkpoint
    monkeypatch.setattr(export, "verify_checkpoint", lambda path: pytest.fail("read before the arguments were checked"))
    for size in ("0GB", "-5GB", "0", -1, "10XB", "5GiB", ""):
        with pytest.raises(CheckpointError, match=r"max_shard_size=.* is not a size: give a positive number of bytes"):
            export.export_hf(str(checkpoint), str(tmp_path / "out"), max_shard_size=size)
    for inside in (checkpoint / "hf_export", checkpoint / "hf" / "x", checkpoint):
        with pytest.raises(CheckpointError, match="inside the checkpoint|already exists"):
            export.export_hf(str(checkpoint), str(inside))
    with pytest.raises(CheckpointError, match="universal folder .* is inside the checkpoint"):  # tools/reshard.py --output
        universal.convert_to_universal(str(checkpoint), str(checkpoint / "universal"))
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(
        p.name for p in (trained / "t1_zero1_untied" / "global_step2").iterdir())
    monkeypatch.setattr(export, "verify_checkpoint", verify)
    result = run_ok([sys.executable, "tools/export_hf.py", str(checkpoint), str(tmp_path / "out"),
                     "--max-shard-size", "300000"], timeout=TIMEOUT)
    assert "exported" in result.stdout and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert all(p.stat().st_size <= 300000 for p in (tmp_path / "out").glob("*.safetensors"))
    assert [c.path for c in list_checkpoints(str(run_dir))] == [str(checkpoint)]  # still resumable


def test_full_disk_during_the_export_says_no_space_left(trained, tmp_path, monkeypatch):
    """The disk fills while a shard is written (ENOSPC from the file system): one error naming the folder
    and its free space, no hint about another layout, and no partial export left."""
    import builtins
    import errno

    from ntl_pretrain.checkpoint import CheckpointError, export_hf
    from ntl_pretrain.checkpoint import export as export_module

    class FullDisk:
        def __init__(self, handle):
            self.handle, self.written = handle, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        return FullDisk(handle) if str(path).endswith(".safetensors") else handle

    monkeypatch.setattr(export_module, "open", open_on_a_full_disk, raising=False)
    with pytest.raises(CheckpointError) as caught:
        export_hf(str(trained / "t1_zero3_tied" / "global_step2"), str(tmp_path / "hf"))
    message = str(caught.value)
    assert message.startswith(f"no space left on {str(tmp_path)!r} (") and "MiB free" in message, message
    assert "layout" not in message and "unexpected pos" not in message
    assert list(tmp_path.iterdir()) == []
