"""No host syncs in the training step outside logging steps.

The counter (tests/helpers/sync_counter.py) knows every call that makes the host wait for a GPU; the first
tests exercise each entry of its list. Then the real Trainer (2 CPU processes, ZeRO-3, DeepSpeed engines)
runs optimizer steps of 2 micro-batches as `Trainer.fit` does (the step, its log, the pre-emption
agreement) while those calls are counted: our code makes none in a step that does not log and exactly one
(the logged figures) in a logging step, and one in a validation (the mixture's and each source's figures),
for the full and the chunked head, T=1 (dp=2) and T=2, reweigh on
and off, and Ulysses sp=2 with number-level NTL. DeepSpeed's own calls per step are counted and printed (its
overflow check reads the gradient norm).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from helpers.launch import DEMO, demo_overrides
from helpers.sync_counter import SYNCING_OPS, SyncCounter
from ntl_pretrain.runtime.supervisor import COMMAND_START_ENV
from ntl_pretrain.observability.throughput import peak_tflops_per_device

TIMEOUT = 400
SEQ_LEN = 64
LOG_EVERY = 3  # the warm-up is step 1 (a logging step); counted: step 2 (plain) and step 3 (logging)
STEPS = 2
LAYOUTS = [1, 2]  # tp_size; each launch runs every head case, one Trainer after the other
CHUNKED = {"chunk0": ["loss.chunk_tokens=0"],  # the full head
           "chunk0_reweigh": ["loss.chunk_tokens=0", "loss.reweigh=true"],
           "chunk48_rows": ["loss.chunk_tokens=48", "loss.chunk_backward=rows"],
           "chunk48_vocab_blocks": ["loss.chunk_tokens=48", "loss.chunk_backward=vocab_blocks"],
           # reweigh: its dense gradient comes with the recomputed blocks, no row count read on the host
           "chunk48_vocab_blocks_reweigh": ["loss.chunk_tokens=48", "loss.chunk_backward=vocab_blocks",
                                            "loss.reweigh=true"]}
# Ulysses sp=2 (in the tp=1 launch, after its other cases): number-level NTL, whose spans exchange runs every step
SEQUENCE_PARALLEL = {"sp2_number_level": ["parallel.sp_size=2", "loss.variant=number_level"],
                     "sp2_chunk48_rows_number_level": ["parallel.sp_size=2", "loss.variant=number_level",
                                                       "loss.chunk_tokens=48", "loss.chunk_backward=rows"]}
multiprocess = [pytest.mark.multiprocess, pytest.mark.timeout(5 * TIMEOUT)]  # the fixture: 2 launches


# Each entry of SYNCING_OPS, exercised the way user code spells it (name -> call); every one must be counted.
def _examples() -> dict:
    t, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    repeats = torch.tensor([1, 2, 0, 1, 1, 1])
    return {
        "item / bool / int / float / format (_local_scalar_dense)": [
            lambda: t[1].item(), lambda: bool(t[1]), lambda: int(t[1]), lambda: float(t[1]),
            lambda: f"{t[1]:.2f}", lambda: t.any() and None],
        "torch.equal": [lambda: torch.equal(t, t)],
        "torch.allclose": [lambda: torch.allclose(t, t)],
        "nonzero / argwhere / torch.where(mask)": [lambda: t.nonzero(), lambda: torch.argwhere(t),
                                                   lambda: torch.where(mask)],
        "masked_select": [lambda: t.masked_select(mask)],
        "unique": [lambda: t.unique(), lambda: torch.unique(t, dim=0), lambda: t.unique_consecutive()],
        "boolean-mask indexing (t[mask], t[mask] = v)": [lambda: t[mask], lambda: t.clone().__setitem__(mask, 0.0)],
        "repeat_interleave without output_size": [lambda: t.repeat_interleave(repeats),
                                                  lambda: torch.repeat_interleave(repeats)],
        "tolist": [lambda: t.tolist()],
        "numpy": [lambda: t.numpy()],
        "cpu()": [lambda: t.cpu()],
        '.to("cpu")': [lambda: t.to("cpu"), lambda: t.to(torch.device("cpu")), lambda: t.to(device="cpu")],
    }


def test_sync_counter_catches_every_listed_op():
    examples = _examples()
    assert set(examples) == {op.name for op in SYNCING_OPS}, "every listed op needs an example here"
    for name, calls in examples.items():
        for call in calls:
            with SyncCounter() as counter:
                call()
            assert counter.by_op[name] >= 1, f"{name}: not counted ({dict(counter.by_op)})"


def test_sync_counter_ignores_ops_that_do_not_sync():
    t, index = torch.arange(6.0), torch.tensor([0, 2])
    with SyncCounter() as counter:
        t[index], t[1:3], t * 2, torch.where(t > 2, t, 0.0), t.sum()  # noqa: B018
        t.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]), output_size=6)
        t.to(torch.float64), t.to("cpu", non_blocking=True), torch.nonzero_static(t, size=6)
    assert not counter.by_op, dict(counter.by_op)


def overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return demo_overrides(assets, out, f"data.seq_len={SEQ_LEN}", "data.micro_batch_size=2", "train.grad_accum_steps=2",
                          "train.max_steps=10", f"train.log_every_n_steps={LOG_EVERY}", "checkpoint.save_final=false",
                          "train.val_batches=2",  # the validation counted after the steps: 2 micro-batches a rank
                          *extra)


@pytest.fixture(scope="module")
def counted(assets, tmp_path_factory) -> Path:
    """The sync counts of every (tp, head) case: one launch per tp."""
    root = tmp_path_factory.mktemp("syncs")
    for tp in LAYOUTS:
        cases = [{"name": f"tp{tp}_{head}", "overrides": overrides(
            assets, root / f"run_tp{tp}_{head}", f"parallel.tp_size={tp}", *head_overrides)}
            for head, head_overrides in {**CHUNKED, **(SEQUENCE_PARALLEL if tp == 1 else {})}.items()]
        (root / f"cases_tp{tp}.json").write_text(json.dumps(cases))
        # as launch/pretrain.sh's supervisor would pass it: the command started an hour ago
        run_workers("trainer_syncs.py", 2, [str(root), str(STEPS), DEMO, str(root / f"cases_tp{tp}.json")],
                    timeout=2 * TIMEOUT, extra_env={COMMAND_START_ENV: repr(time.time() - 3600)})
    return root


@pytest.mark.parametrize("tp,head", [pytest.param(tp, head, marks=multiprocess) for tp in LAYOUTS for head in CHUNKED]
                         + [pytest.param(1, head, marks=multiprocess) for head in SEQUENCE_PARALLEL])
def test_step_syncs_only_to_log(counted, tp, head):
    counts = json.loads((counted / f"tp{tp}_{head}.json").read_text())
    print(json.dumps({k: v for k, v in counts.items() if k != "figures"}, indent=1))
    assert counts["steps"] == ["plain", "logging"]
    deepspeed = {key: n for key, n in counts["by_package"].items() if key.endswith("/deepspeed")}
    print(f"DeepSpeed's own syncs per step (tp={tp}, {head}): {deepspeed}")
    # the data package builds each micro-batch from numpy arrays on the host, before it moves to the device: its
    # tensor calls touch CPU tensors only, on every machine, so they never wait for a device
    ours = {key: n for key, n in counts["sites"].items() if "/ntl_pretrain/" in key and "/ntl_pretrain/data/" not in key}
    plain = {key: n for key, n in ours.items() if key.startswith("plain/")}
    logging = {key: n for key, n in ours.items() if key.startswith("logging/")}
    assert not plain, f"host syncs in a step that does not log: {plain}"
    assert not any("/micro_batch/" in key for key in logging), f"host syncs inside the micro-batch loop: {logging}"
    assert sum(logging.values()) == 1, f"a logging step should read its figures once: {logging}"
    validation = {key: n for key, n in ours.items() if key.startswith("validation/")}
    assert sum(validation.values()) == 1, f"a validation should read its figures once: {validation}"
    assert {"val/loss", "val/sources.0/loss"} <= set(counts["validation"]), counts["validation"]
    plain_figures, logged = counts["figures"]
    assert plain_figures is None
    assert logged["train/ce"] > 0 and logged["train/grad_norm"] > 0 and logged["train/tokens_per_s"] > 0, logged


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=multiprocess) for tp in LAYOUTS])
def test_log_reports_throughput_per_device_and_wall_time_from_the_command(counted, tp):
    from transformers import LlamaConfig, LlamaForCausalLM

    counts = json.loads((counted / f"tp{tp}_chunk0.json").read_text())
    logged, world = counts["figures"][-1], counts["world_size"]
    # model FLOPs per token (PaLM convention) from a reference count of the same model's parameters
    config = LlamaConfig(**{k: v for k, v in counts["model_config"].items() if k not in ("architectures", "dtype")})
    model = LlamaForCausalLM(config)
    matmul_parameters = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    flops_per_token = 6 * matmul_parameters + 12 * config.num_hidden_layers * config.hidden_size * SEQ_LEN
    assert logged["train/tokens_per_s_per_device"] == pytest.approx(logged["train/tokens_per_s"] / world)
    assert logged["train/tflops_per_device"] == pytest.approx(
        flops_per_token * logged["train/tokens_per_s"] / world / 1e12, rel=1e-6)
    assert peak_tflops_per_device(torch.device("cpu")) is None and "train/mfu" not in logged  # no peak on CPU
    # the wall time counts from the command's start (an hour before the ranks ran), not the trainer's
    assert " steps in 60." in counts["summary"] or " steps in 61." in counts["summary"], counts["summary"]
