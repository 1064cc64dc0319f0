"""Checkpoints end to end with the real launcher and 2 CPU processes (ZeRO-3, AutoTP T=2 unless said).

One uninterrupted reference run (6 steps, a checkpoint every step, keep the last 2, step 4 permanent,
HF export at the end) is compared with an interrupted run of the same config: SIGTERM to one rank
(every rank saves and exits 0), a resume with checkpoint.async_save killed with `kill -9` in the middle of its
first save (the kill of a rank in the middle of the background write itself: tests/test_checkpoint_async.py),
and a second resume (saving in the background too) that must pick the previous checkpoint and reach bitwise
the same weights and losses.
The reference's step-4 checkpoint is also resumed as T=1/dp=2 and T=1/dp=1 (universal checkpoint),
and the T=1/dp=1 run then meets a file-size limit while saving (EFBIG: a disk-full stand-in). A T=1/dp=2
resume plan whose universal conversion outlasts the process group's timeout waits for it (no collective).
A streamed source at T=1/dp=2 (the demo's one file: each rank reads its own byte range) resumed from the
step-2 checkpoint gives the losses and weights of the uninterrupted run (one launch of the real Trainer,
three runs in it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from ntl_pretrain.checkpoint import MANIFEST_NAME, step_of_tag, verify_checkpoint

from helpers.distributed import run_workers  # noqa: E402
from helpers.launch import REPO, demo_args, deepspeed_command, launch_env, run  # noqa: E402
from helpers.tensorboard import scalars as _scalars  # noqa: E402

TIMEOUT = 300  # a hang (a rank waiting on a dead one) fails the test instead of blocking the suite
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(4 * TIMEOUT)]


def _overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return demo_args(assets, out, "train.max_steps=6", *extra)


def _launch(procs: int, args: list[str], prefix: str = "") -> list[str]:
    return deepspeed_command(procs, *args, prefix=prefix)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return run(command, timeout=TIMEOUT)


def _fp32_partitions(checkpoint: Path) -> dict[str, list[torch.Tensor]]:
    """The fp32 master weights of every ZeRO/TP partition file of a checkpoint."""
    found = {}
    for path in sorted(checkpoint.glob("*optim_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        found[path.name] = list(state["optimizer_state_dict"]["fp32_flat_groups"])
    return found


def _rank_processes(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    ranks = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            for arg in child.cmdline():
                if arg.startswith("--local_rank="):
                    ranks[int(arg.split("=", 1)[1])] = child
        except psutil.NoSuchProcess:
            continue
    return ranks


def _wait_for(predicate, timeout: float, interval: float = 0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = _run(_launch(2, _overrides(assets, out, "checkpoint.every_n_steps=1", "checkpoint.keep_last=2",
                                        "checkpoint.keep_every_n_steps=4", "checkpoint.export_hf_at_end=true")))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def interrupted(assets, reference, tmp_path_factory) -> dict:
    """The same run, stopped by SIGTERM, resumed and killed mid-save, resumed again to the end."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    info: dict = {"out": out}
    # 1. SIGTERM to rank 1 only, once step 2 is done: all ranks save at the next step boundary and exit 0
    launcher = subprocess.Popen(_launch(2, _overrides(assets, out, "checkpoint.every_n_steps=0")), cwd=REPO,
                                env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith("step 2:"):
                _rank_processes(launcher)[1].send_signal(signal.SIGTERM)
                break
        rest, _ = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    info["sigterm_output"] = "".join(lines) + rest
    info["sigterm_rc"] = launcher.returncode
    info["stopped_at"] = int((out / "latest").read_text().strip()[len("global_step"):])
    # 2. resume, saving every step with checkpoint.async_save; kill -9 rank 1 in the middle of the first save
    launcher = subprocess.Popen(_launch(2, _overrides(assets, out, "train.resume=auto", "checkpoint.every_n_steps=1",
                                                      "checkpoint.async_save=true")),
                                cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        staging = _wait_for(lambda: [p for p in out.iterdir() if p.name.endswith(".partial")], timeout=TIMEOUT)
        rank1 = _rank_processes(launcher)[1]
        rank1.suspend()  # frozen mid-save: rank 0 cannot commit without it
        time.sleep(0.5)
        info["staging"] = [p.name for p in staging]
        info["committed_before_kill"] = sorted(p.name for p in out.iterdir() if step_of_tag(p.name) is not None)
        rank1.kill()
        info["killed_output"], _ = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    info["killed_rc"] = launcher.returncode
    # 3. resume again (the real Trainer in 2 worker processes, saving in the background: its checkpoints must
    # equal the uninterrupted run's synchronous ones), then the trained model's gathered logits
    logits_file = out.parent / "logits.pt"
    outputs = run_workers("checkpoint_resume_logits.py", 2,
                          [str(logits_file), *_overrides(assets, out, "train.resume=auto", "checkpoint.every_n_steps=1",
                                                         "checkpoint.async_save=true")[1:]],
                          timeout=TIMEOUT)
    info["resume_output"] = outputs[0]
    info["logits"] = torch.load(logits_file)
    return info


def test_keep_last_k_and_permanent_checkpoints(reference):
    tags = sorted(p.name for p in reference.iterdir() if p.name.startswith("global_step"))
    assert tags == ["global_step4", "global_step5", "global_step6"]  # last 2 + the permanent step 4
    assert (reference / "latest").read_text() == "global_step6"
    manifest = verify_checkpoint(str(reference / "global_step4"))
    assert manifest["permanent"] and manifest["step"] == 4 and manifest["tokens_seen"] == 4 * 8 * 128
    assert manifest["layout"] == {"world_size": 2, "dp_size": 1, "tp_size": 2, "zero_stage": 3, "sp_size": 1}
    files = manifest["files"]
    assert {"rng_state_0.pt", "rng_state_1.pt", "hf/config.json", "hf/tokenizer.json", "hf/number_vocab.json"} <= set(files)
    assert any("mp_rank_00" in f for f in files) and any("mp_rank_01" in f for f in files)
    assert not [p for p in reference.rglob("*.partial")]
    state = torch.load(reference / "global_step6" / "zero_pp_rank_0_mp_rank_01_model_states.pt", weights_only=False)
    assert state["step"] == 6 and state["data"]["position"] == 6 * 8 and state["ntl_lambda"] == pytest.approx(0.3)


def test_sigterm_on_one_rank_saves_and_every_rank_exits_0(interrupted):
    output, stopped = interrupted["sigterm_output"], interrupted["stopped_at"]
    assert interrupted["sigterm_rc"] == 0, output[-4000:]
    assert 2 <= stopped < 6, output[-3000:]
    assert f"step {stopped}: SIGTERM received (pre-emption): saving a checkpoint" in output
    assert f"pre-empted at step {stopped}: global_step{stopped} saved" in output
    assert output.count("exits successfully") == 2  # the launcher saw both ranks exit 0


def test_kill_9_mid_save_resumes_from_the_previous_checkpoint(interrupted):
    stopped = interrupted["stopped_at"]
    assert interrupted["staging"] == [f"global_step{stopped + 1}.partial"]
    assert interrupted["committed_before_kill"] == [f"global_step{stopped}"]  # the partial save never counted
    assert interrupted["killed_rc"] != 0
    assert f"resumed from {interrupted['out'] / f'global_step{stopped}'} at step {stopped}" in interrupted["resume_output"]


def test_resumed_run_matches_the_uninterrupted_one_bitwise(interrupted, reference):
    out = interrupted["out"]
    assert (out / "latest").read_text() == "global_step6"
    resumed, uninterrupted = _fp32_partitions(out / "global_step6"), _fp32_partitions(reference / "global_step6")
    assert resumed.keys() == uninterrupted.keys() and len(resumed) == 2
    for name in resumed:
        assert all(torch.equal(a, b) for a, b in zip(resumed[name], uninterrupted[name])), name
    for name in ("rng_state_0.pt", "rng_state_1.pt"):  # train.seed seeds Python's, NumPy's and torch's: the same file
        assert (out / "global_step6" / name).read_bytes() == (reference / "global_step6" / name).read_bytes(), name
    # TensorBoard: every step once (the killed run's points after its checkpoint are purged), same values
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    written = [e.step for f in sorted((out / "tensorboard").glob("events.*")) for e in EventFileLoader(str(f)).Load()
               if any(v.tag == "train/loss" for v in e.summary.value)]
    stopped = interrupted["stopped_at"]
    assert written.count(stopped + 1) == 2  # on disk twice: by the run killed mid-save, and by the resume
    got, want = _scalars(out / "tensorboard"), _scalars(reference / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/lr"):
        assert [s for s, _ in got[tag]] == list(range(1, 7)), tag
        assert [v for _, v in got[tag]] == [v for _, v in want[tag]], tag


def test_export_reloads_with_the_training_models_logits(interrupted, reference, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ntl_pretrain.numbers import NumberVocab

    export = tmp_path / "hf"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "tools/export_hf.py", str(interrupted["out"] / "global_step6"), str(export),
                             "--max-shard-size", "1MB"], cwd=REPO, env=launch_env(), capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"export: {time.perf_counter() - started:.1f} s")
    index = json.loads((export / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((export / s).is_file() for s in shards)  # ~3.5 MB of fp32 in 1 MB shards
    for name in ("config.json", "generation_config.json", "tokenizer.json", "number_vocab.json"):
        assert (export / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.dtype == torch.float32
    reference_logits = interrupted["logits"]
    with torch.no_grad():
        logits = model(input_ids=reference_logits["input_ids"]).logits
    assert logits.shape == reference_logits["logits"].shape
    torch.testing.assert_close(logits, reference_logits["logits"], rtol=1e-5, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert NumberVocab.load(export).token_ids == NumberVocab.from_tokenizer(tokenizer).token_ids
    # the export made at the end of the uninterrupted run holds the same weights, bit for bit
    at_end = reference / "hf_export"
    ours = {k: v for s in shards for k, v in load_file(export / s).items()}
    theirs = load_file(at_end / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _copy_checkpoint(reference: Path, tag: str, out: Path) -> None:
    out.mkdir(parents=True)
    shutil.copytree(reference / tag, out / tag)
    (out / "latest").write_text(tag)


def test_resume_t2_checkpoint_as_t1_on_two_data_parallel_ranks(reference, assets, tmp_path):
    out = tmp_path / "run"
    _copy_checkpoint(reference, "global_step4", out)
    result = _run(_launch(2, _overrides(assets, out, "parallel.tp_size=1", "data.micro_batch_size=4",
                                        "train.max_steps=5", "train.resume=auto", "checkpoint.save_final=false")))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "dp=2 tp=1 zero=3" in result.stdout
    assert (out / "global_step4_universal" / MANIFEST_NAME).is_file()
    got, want = _scalars(out / "tensorboard"), _scalars(reference / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl"):
        assert got[tag][-1][0] == 5
        assert got[tag][-1][1] == pytest.approx(want[tag][4][1], rel=1e-5), tag


def test_resume_t2_checkpoint_on_one_process_then_a_failed_save_keeps_the_previous(reference, assets, tmp_path):
    out = tmp_path / "run"
    _copy_checkpoint(reference, "global_step4", out)
    before = {p.name: p.stat().st_size for p in (out / "global_step4").iterdir() if p.is_file()}
    # 8 MiB file-size limit: the universal conversion's files fit (< 4 MB), the one-process optimizer shard
    # (~11 MB) cannot be written (EFBIG, like a full disk)
    result = _run(_launch(1, _overrides(assets, out, "parallel.tp_size=1", "train.max_steps=5", "train.resume=auto"),
                          prefix="ulimit -f 8192"))
    assert result.returncode != 0
    assert "dp=1 tp=1 zero=3" in result.stdout
    got, want = _scalars(out / "tensorboard"), _scalars(reference / "tensorboard")
    assert got["train/loss"][-1][0] == 5
    assert got["train/loss"][-1][1] == pytest.approx(want["train/loss"][4][1], rel=1e-5)
    message = result.stderr + result.stdout
    assert "error: saving checkpoint global_step5 failed on rank 0" in message, message[-4000:]
    assert "the previous checkpoint global_step4 is intact" in message
    # nothing of the previous checkpoint was touched; the failed one never became a checkpoint
    assert {p.name: p.stat().st_size for p in (out / "global_step4").iterdir() if p.is_file()} == before
    verify_checkpoint(str(out / "global_step4"))
    assert (out / "latest").read_text() == "global_step4"
    assert not (out / "global_step5").exists()


def test_resume_errors_on_real_checkpoints(reference, tmp_path, bpe_tokenizer):
    """A truncated shard, another tokenizer or model, another layout without resharding: clear errors,
    nothing loaded, nothing changed."""
    from transformers import AutoConfig, AutoTokenizer

    from ntl_pretrain.checkpoint import CheckpointError, CheckpointManager, fingerprint, resolve_resume
    from ntl_pretrain.config import CheckpointConfig
    from ntl_pretrain.parallel.layout import ParallelLayout
    from ntl_pretrain.numbers import NumberVocab

    out = tmp_path / "run"
    _copy_checkpoint(reference, "global_step5", out)
    shutil.copytree(reference / "global_step6", out / "global_step6")
    shard = out / "global_step6" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    before = {str(p): p.stat().st_size for p in out.rglob("*")}
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_01_optim_states.pt has \d+ bytes, \d+ were "
                                              r"written \(a truncated shard\)"):
        resolve_resume(str(out), "global_step6")
    assert resolve_resume(str(out), "auto") == "global_step5"  # the damaged newest one is skipped
    result = subprocess.run([sys.executable, "tools/export_hf.py", str(out / "global_step6"), str(tmp_path / "hf")],
                            cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2 and "a truncated shard" in result.stderr and not (tmp_path / "hf").exists()

    # the fingerprint rebuilt from the checkpoint's own model config, tokenizer and number vocabulary matches
    assets = out / "global_step5" / "hf"
    config, tokenizer = AutoConfig.from_pretrained(assets), AutoTokenizer.from_pretrained(assets)
    numbers = NumberVocab.load(assets)
    t2 = ParallelLayout.of(2, 0, 0, tp_size=2)
    same = CheckpointManager(CheckpointConfig(), str(out), t2, 3, fingerprint(config, tokenizer, numbers), seed=1)
    assert same.plan_resume("global_step5") == "global_step5"
    other_tokenizer = CheckpointManager(CheckpointConfig(), str(out), t2, 3, fingerprint(config, bpe_tokenizer, numbers), seed=1)
    with pytest.raises(CheckpointError, match=r"saved with a different tokenizer .*\(saved: 487 tokens; this run: 400\)"):
        other_tokenizer.plan_resume("global_step5")
    bigger = AutoConfig.from_pretrained(assets, hidden_size=256)
    other_model = CheckpointManager(CheckpointConfig(), str(out), t2, 3, fingerprint(bigger, tokenizer, numbers), seed=1)
    with pytest.raises(CheckpointError, match="saved with a different model"):
        other_model.plan_resume("global_step5")
    t1 = ParallelLayout.of(2, 0, 0, tp_size=1)
    no_reshard = CheckpointManager(CheckpointConfig(reshard_on_resume=False), str(out), t1, 3,
                                   fingerprint(config, tokenizer, numbers), seed=1)
    with pytest.raises(CheckpointError, match=r"saved with world 2 = dp 1 x tp 2, ZeRO-3; this run has world 2 = dp 2 "
                                              r"x tp 1, ZeRO-3. Set checkpoint.reshard_on_resume=true"):
        no_reshard.plan_resume("global_step5")
    assert {str(p): p.stat().st_size for p in out.rglob("*")} == before


def test_resume_on_another_layout_waits_for_a_conversion_longer_than_the_collective_timeout(reference, tmp_path):
    """Rank 0's universal conversion outlasts the process group's timeout (2 s, a stand-in for
    dist_timeout_minutes): the other rank waits outside any collective, then gets its error or its result."""
    out = tmp_path / "run"
    _copy_checkpoint(reference, "global_step4", out)
    outputs = run_workers("reshard_wait.py", 2, [str(out), "global_step4", "2", "5"], timeout=TIMEOUT)
    reports = [json.loads(next(line for line in o.splitlines() if line.startswith('{"rank"'))) for o in outputs]
    assert [r["conversions"] for r in reports] == [2, 0]  # rank 0 alone converts
    for report in reports:
        failed, converted = report["outcomes"]
        assert failed["error"] == "AgreedCheckpointError" and failed["message"] == "injected conversion failure"
        assert converted["tag"] == "global_step4_universal"
        assert failed["waited_s"] > 4 and converted["waited_s"] > 4  # twice the 2 s timeout, and more
    assert reports[0]["outcomes"][0]["read_by"] == 1  # rank 0 stayed until rank 1 had read its error
    manifest = verify_checkpoint(str(out / "global_step4_universal"))
    assert manifest["universal_of"] == "global_step4"


def _plain_validation(export: Path, config: Path) -> dict[str, tuple[float, float, float]]:
    """(loss, CE, NTL) of the exported model on the run's held-out samples, by plain torch and the ntloss package:
    per source, its own held-out samples (a run of that source alone holds them out) in whole micro-batches, up to
    train.val_batches micro-batches per data-parallel rank; the mixture (`val`), the first train.val_batches
    global batches of the sources' samples in order."""
    import ntloss
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.documents import document_slices
    from ntl_pretrain.config import load_config
    from ntl_pretrain.data import PretrainingData
    from ntl_pretrain.data.stream import _to_micro_batch

    cfg = load_config(config)
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    mbs, dp, batches = cfg.data.micro_batch_size, 2, cfg.train.val_batches
    held = []
    for source in cfg.data.sources:
        alone = PretrainingData.build(dataclasses.replace(cfg.data, sources=[source], stages=[]), tokenizer,
                                      dp_rank=0, dp_size=1)
        held.append(alone.validation[: len(alone.validation) // mbs * mbs])
    mixture = [sample for samples in held for sample in samples]
    sets = {"val": mixture[: min(batches, len(mixture) // (mbs * dp)) * mbs * dp],
            **{f"val/sources.{i}": samples[: batches * mbs * dp] for i, samples in enumerate(held)}}
    figures = {}
    for prefix, samples in sets.items():
        batch = _to_micro_batch(samples, tokenizer.eos_token_id if cfg.data.mask_document_start else None)
        logits = torch.empty(*batch.input_ids.shape, model.config.vocab_size)
        with torch.no_grad():  # data.document_mask: each packed document alone
            for b, row in enumerate(batch.input_ids):
                for part in document_slices(row, tokenizer.eos_token_id):
                    logits[b, part] = model(input_ids=row[part].unsqueeze(0)).logits[0]
        ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100).item()
        ntl = ntloss.NTLoss(tokenizer, vocab_size=logits.shape[-1], digit_level=True, reweigh=False)(
            logits, batch.labels).item()
        figures[prefix] = (ce + cfg.loss.ntl_weight * ntl, ce, ntl)
    return figures


def test_streamed_source_on_two_data_parallel_ranks_resumes_as_the_uninterrupted_run(assets, tmp_path):
    """One 2-process launch of the real Trainer, three runs in it: 4 uninterrupted steps; 2 steps; the same
    folder resumed to step 4. The stream state of each rank (its position in its byte range of the demo's one
    file) is saved at step 2 and sought to, and steps 3 and 4 train bitwise what the uninterrupted run did.
    A staged mixture switches at step 3 (the resumed run's first step): the streamed source alone, then mixed with
    the same file read in memory (data.stages; TensorBoard's data/stage and data/source_share/* agree too).
    Each run validates the mixture and each source (val/*, val/sources.N/*) at steps 2 and 4: the same resumed as
    uninterrupted, step 4's equal to a plain recomputation on the held-out samples (`_plain_validation`)."""
    streamed = ["parallel.tp_size=1", "data.sources.0.streaming=true", "data.micro_batch_size=4",
                f"data.sources.1.path={assets / 'arithmetic.jsonl'}", "data.sources.1.generate_arithmetic=3000",
                "data.sources.1.generate_options={train_digits: [1, 2], ops: ['+', '-']}",  # the demo's: one corpus
                "data.stages=[{start_step: 1, weights: [1, 0]}, {start_step: 3, weights: [1, 1]}]",
                "optim.lr_schedule=constant", "optim.warmup_steps=2", "checkpoint.every_n_steps=1",
                "checkpoint.keep_last=0", "checkpoint.resume_lr_schedule=keep",
                "train.val_every_n_steps=2", "train.val_batches=2"]  # validation per source at steps 2 and 4
    straight, split = tmp_path / "straight", tmp_path / "split"

    def run_args(out: Path, logits: str, *extra: str) -> list[str]:
        return [str(tmp_path / logits), *demo_args(assets, out, *streamed, *extra)[1:]]

    outputs = run_workers("checkpoint_resume_logits.py", 2,
                          [*run_args(straight, "straight.pt", "train.max_steps=4"), "--",
                           *run_args(split, "first.pt", "train.max_steps=2"), "--",
                           *run_args(split, "resumed.pt", "train.max_steps=4", "train.resume=auto")],
                          timeout=TIMEOUT)
    assert "each rank reads its own contiguous bytes" in outputs[0]  # one file, two ranks: split by byte range
    assert f"resumed from {split / 'global_step2'} at step 2" in outputs[0]
    assert "stage 1: steps 3-4: sources.0 0.500, sources.1 0.500" in outputs[0]  # the stage table at start-up
    assert outputs[0].count("step 3: data stage 1 begins (sources.0 0.500, sources.1 0.500)") == 2  # straight, resumed
    # rank 0 (the one that logs) sought its stream to its saved row, not re-reading the file up to it
    assert re.search(r"data.sources.0: this rank's stream resumes at its sample \d+, sought to 'arithmetic.jsonl' "
                     r"byte [1-9]\d*", outputs[0])
    got, want = _scalars(split / "tensorboard"), _scalars(straight / "tensorboard")
    assert [v for _, v in got["data/stage"]] == [0, 0, 1, 1]
    replayed = [v for _, v in got["data/source_share/sources.1"]]  # in memory: not in stage 0, drawn in stage 1
    assert replayed[:2] == [0, 0] and sum(replayed[2:]) > 0
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/lr", "data/source_share/sources.0",
                "data/source_share/sources.1"):
        assert [s for s, _ in got[tag]] == [1, 2, 3, 4], tag
        assert [v for _, v in got[tag]] == [v for _, v in want[tag]], tag
    # validation: the mixture's and each source's, at steps 2 and 4 (either side of the stage switch), the
    # resumed run's the uninterrupted one's; step 4's recomputed from the checkpoint's export
    val_tags = [f"val/{part}{figure}" for part in ("", "sources.0/", "sources.1/") for figure in ("loss", "ce", "ntl")]
    for tag in val_tags:
        assert [s for s, _ in got[tag]] == [2, 4] and [v for _, v in got[tag]] == [v for _, v in want[tag]], tag
    export = tmp_path / "hf"
    subprocess.run([sys.executable, "tools/export_hf.py", str(straight / "global_step4"), str(export)], check=True,
                   cwd=REPO, env=launch_env(), capture_output=True, timeout=TIMEOUT)
    logged = {tag: dict(want[tag])[4] for tag in val_tags}
    for prefix, (loss, ce, ntl) in _plain_validation(export, straight / "config.yaml").items():
        assert logged[f"{prefix}/ce"] == pytest.approx(ce, rel=1e-5), prefix
        assert logged[f"{prefix}/ntl"] == pytest.approx(ntl, rel=1e-5), prefix
        assert logged[f"{prefix}/loss"] == pytest.approx(loss, rel=1e-5), prefix
    assert torch.equal(torch.load(tmp_path / "resumed.pt")["logits"], torch.load(tmp_path / "straight.pt")["logits"])
    # the checkpoint holds each rank's own place: rank 1's lies in the second half of the file
    states = torch.load(sorted((split / "global_step2").glob("*model_states.pt"))[0], weights_only=False)
    saved = states["data"]["streams"]["data.sources.0"]
    size = (assets / "arithmetic.jsonl").stat().st_size
    assert saved["per_rank"] and [rank["at"]["row"]["offset"] >= size // 2 for rank in saved["ranks"]] == [False, True]
