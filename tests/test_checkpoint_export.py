"""Export of every checkpoint layout to a Hugging Face folder (issue 12 item 0): the trained model's logits
from `from_pretrained` equal the engine's (gathered over the tensor-parallel shards).

DeepSpeed's universal form stores `zero/<name>/fp32.pt` as a bare flat tensor for ZeRO-3 without tensor
parallelism and needs injected metadata for ZeRO 1/2 without it; each layout below trains 2 steps on 2
CPU processes with `checkpoint.export_hf_at_end=true` (the trainer's export), and one is also exported
with `tools/export_hf.py`. T=2 with ZeRO-3 and untied embeddings is covered by test_checkpoint_resume.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 400
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * TIMEOUT)]

LAYOUTS = {  # name: (tp_size, zero_stage, tie_word_embeddings)
    "t1_zero1_untied": (1, 1, False),
    "t1_zero2_tied": (1, 2, True),
    "t1_zero3_untied": (1, 3, False),
    "t1_zero3_tied": (1, 3, True),
    "t2_zero1_tied": (2, 1, True),
}


def _env() -> dict:
    import os

    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_assets")


def _train(assets: Path, out: Path, tp: int, zero: int, tied: bool) -> dict:
    """2 steps on 2 processes with the export at the end; the trained engine's logits on a fixed text."""
    logits_file = out.parent / f"{out.name}_logits.pt"
    overrides = ["configs/demo.yaml", f"data.sources.0.path={assets / 'arithmetic.jsonl'}",
                 "data.sources.0.generate_arithmetic=3000", f"tokenizer.name_or_path={assets / 'tokenizer'}",
                 f"data.cache_dir={assets / 'cache'}", "data.validation_documents=100", f"train.output_dir={out}",
                 "monitor.progress_bar=never", "train.val_every_n_steps=-1", "eval.at_end=false", "train.max_steps=2",
                 f"parallel.tp_size={tp}", f"parallel.zero_stage={zero}", f"data.micro_batch_size={8 // (2 // tp)}",
                 f"model.architecture.tie_word_embeddings={str(tied).lower()}", "checkpoint.export_hf_at_end=true"]
    run_workers("checkpoint_resume_logits.py", 2, [str(logits_file), *overrides], timeout=TIMEOUT)
    return torch.load(logits_file)


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
def test_export_of_every_layout_reloads_with_the_engines_logits(name, assets, tmp_path):
    tp, zero, tied = LAYOUTS[name]
    out = tmp_path / "run"
    reference = _train(assets, out, tp, zero, tied)
    assert reference["step"] == 2
    _assert_same_logits(out / "hf_export", reference, tied)  # checkpoint.export_hf_at_end
    if name in ("t1_zero3_tied", "t1_zero1_untied"):  # the command-line tool on the same checkpoint
        export = tmp_path / "hf"
        result = subprocess.run([sys.executable, "tools/export_hf.py", str(out), str(export)], cwd=REPO, env=_env(),
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        _assert_same_logits(export, reference, tied)
