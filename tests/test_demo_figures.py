"""The demo's figures that docs/training.md prints are those a run of configs/demo.yaml computes: its step 1
(loss, CE, NTL, lr, gradient norm) recomputed in this process from the demo's own corpus, tokenizer, first batch
and initial weights, with torch's cross-entropy and the ntloss package, without the trainer's loss code or a
launch. The figures went stale once (issue 47: step 1's gradient norm documented as 4.699, a run printed 2.867,
after document masking was switched on); anything that changes step 1 (the corpus, the tokenizer, the data
order, the initial weights, the attention, the loss) now fails here until the docs are updated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "training.md"


def documented_step_1() -> dict[str, str]:
    """`step 1: loss=... ce=... ntl=... lr=... gnorm=...` of the demo's output block, as printed."""
    found = re.search(r"^step 1: (loss=\S+ ce=\S+ ntl=\S+ lr=\S+ gnorm=\S+)", DOCS.read_text(), re.MULTILINE)
    assert found, "docs/training.md has no demo line 'step 1: loss=... gnorm=...'"
    return dict(item.split("=") for item in found.group(1).split())


def _printed_digits(text: str) -> float:
    """Half a unit of the last digit printed: what the printed figure's rounding leaves open."""
    mantissa = text.lower().split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(text.lower().split("e")[1]) if "e" in text.lower() else 0
    return 0.5 * 10.0 ** (exponent - decimals)


def test_the_documented_demo_step_1_is_what_the_demo_computes(tmp_path):
    import ntloss
    import torch
    import torch.nn.functional as F

    from helpers.documents import document_slices
    from ntl_pretrain.config import load_config
    from ntl_pretrain.data import PretrainingData
    from ntl_pretrain.models.build import build_model, load_run_tokenizer
    from ntl_pretrain.trainer.startup import prepare_assets

    # the demo's config as a new user runs it (T=2 on 2 CPU processes: one data-parallel rank), its assets here
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        f"data.sources.0.path={tmp_path / 'arithmetic.jsonl'}", f"tokenizer.name_or_path={tmp_path / 'tokenizer'}",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}"])
    prepare_assets(cfg)
    tokenizer = load_run_tokenizer(cfg.tokenizer, cfg.model)
    data = PretrainingData.build(cfg.data, tokenizer, dp_rank=0, dp_size=1)
    (batch,) = data.next_step(cfg.train.grad_accum_steps)
    model, _ = build_model(cfg.model, tokenizer, tp_size=2)
    model.train()
    logits = torch.zeros(*batch.input_ids.shape, model.config.vocab_size)
    assert cfg.data.document_mask  # attention inside each packed document: each document runs alone here
    for b, row in enumerate(batch.input_ids):
        for part in document_slices(row, tokenizer.eos_token_id):
            logits[b, part] = model(input_ids=row[part].unsqueeze(0)).logits[0]
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    ntl = ntloss.NTLoss(tokenizer, vocab_size=logits.shape[-1], digit_level=True, reweigh=False)(logits, batch.labels)
    assert cfg.loss.variant == "was" and cfg.loss.ntl_schedule == "constant"
    loss = ce + cfg.loss.ntl_weight * ntl
    loss.backward()
    gnorm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    lr = cfg.optim.lr * 1 / cfg.optim.warmup_steps  # step 1 of the linear warm-up
    computed = {"loss": loss.item(), "ce": ce.item(), "ntl": ntl.item(), "lr": lr, "gnorm": gnorm.item()}
    documented = documented_step_1()
    for name, value in computed.items():
        assert float(documented[name]) == pytest.approx(value, abs=_printed_digits(documented[name]) + 1e-6 * value), (
            f"docs/training.md's demo prints step 1 {name}={documented[name]}, the demo computes {value:.6g}: run the "
            f"demo (bash launch/pretrain.sh --config configs/demo.yaml) and update the figures", computed)
