"""The project's own trainer: how one global batch is split (gradient accumulation steps, micro-batch size)
does not change the step. CE and NTL are each normalised by the token counts of the whole global batch
(`trainer/training_objective.py`), so 1 micro-batch of 4 sequences and 4 micro-batches of 1 give the same
loss, CE, NTL and gradient norm at step 1, and the same at step 2 (after the same update), for one NTL
variant of each kind (tests/helpers/variants.py: was, number_level, del, digit_entropy), on 2 data-parallel ranks
and under Ulysses sp=2 (issue 35 item 2; the Hugging Face Trainer's counterpart is tests/test_loss_hf_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.distributed import run_workers
from helpers.launch import DEMO, demo_overrides
from helpers.variants import LARGE_TERM_OPTIONS, ROW_LOCAL_OPTIONS, one_variant_of_each_kind, options_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

STEPS = 2
SPLITS = {"micro4_accum1": ["data.micro_batch_size=4", "train.grad_accum_steps=1"],
          "micro1_accum4": ["data.micro_batch_size=1", "train.grad_accum_steps=4"]}
# one variant of each kind (from the registry): its overrides, the options it reads of these: del with its runs per
# row (the authors' runs over the flattened micro-batch join the rows of a micro-batch, which the two splits group
# differently) and c = 1 to matter
VARIANTS = {variant: [f"loss.{key}={value}" for key, value in {**ROW_LOCAL_OPTIONS, **LARGE_TERM_OPTIONS}.items()
                      if key in options_of(variant)] for variant in one_variant_of_each_kind()}
TAGS = ("train/loss", "train/ce", "train/ntl", "train/grad_norm")


@pytest.fixture(scope="module")
def split_runs(assets, tmp_path_factory) -> Path:
    """Every (sp, variant, split) case: one 2-process launch per sp size, its Trainers one after the other."""
    root = tmp_path_factory.mktemp("accumulation")
    for sp in (1, 2):
        cases = [{"name": f"sp{sp}_{variant}_{split}", "overrides": demo_overrides(
            assets, root / f"run_sp{sp}_{variant}_{split}", "data.seq_len=64", "train.max_steps=10",
            "parallel.tp_size=1", f"parallel.sp_size={sp}", f"loss.variant={variant}", "checkpoint.save_final=false",
            *VARIANTS[variant], *overrides)} for variant in VARIANTS for split, overrides in SPLITS.items()]
        (root / f"cases_sp{sp}.json").write_text(json.dumps(cases))
        run_workers("trainer_accumulation.py", 2, [str(root), str(STEPS), DEMO, str(root / f"cases_sp{sp}.json")],
                    timeout=800)
    return root


@pytest.mark.parametrize("sp", [1, 2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_split_of_the_global_batch_does_not_change_the_step(split_runs, sp, variant):
    runs = {split: json.loads((split_runs / f"sp{sp}_{variant}_{split}.json").read_text())["figures"]
            for split in SPLITS}
    reference = runs["micro4_accum1"]
    assert len(reference) == STEPS and all(figures["train/ntl"] > 0 for figures in reference), reference
    for split, figures in runs.items():
        for step in range(STEPS):
            for tag in TAGS:
                assert figures[step][tag] == pytest.approx(reference[step][tag], rel=1e-5, abs=1e-7), (
                    split, step + 1, tag)
