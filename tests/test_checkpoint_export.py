"""Export of every checkpoint layout to a Hugging Face folder (issue 12 item 0): the trained model's logits
from `from_pretrained` equal the engine's (gathered over the tensor-parallel shards).

DeepSpeed's universal form stores `zero/<name>/fp32.pt` as a bare flat tensor for ZeRO-3 without tensor
parallelism and needs injected metadata for ZeRO 1/2 without it; each layout below trains 2 steps on 2
CPU processes with `checkpoint.export_hf_at_end=true` (the trainer's export), and two are also exported
with `tools/export_hf.py`. T=2 with ZeRO-3 and untied embeddings is covered by test_checkpoint_resume.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from helpers.launch import DEMO, demo_overrides, run_ok

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
    if name in ("t1_zero3_tied", "t1_zero1_untied"):  # the command-line tool on the same checkpoint
        export = tmp_path / "hf"
        run_ok([sys.executable, "tools/export_hf.py", str(out), str(export)], timeout=TIMEOUT)
        _assert_same_logits(export, reference, tied)
