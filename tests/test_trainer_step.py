"""The trainer's own step (`Trainer.train_step`, real DeepSpeed engines, 2 CPU processes) against a single-process
reference written with plain PyTorch and the `ntloss` package: the same CE, NTL, loss and gradient norm, and the
same weights after AdamW, for ZeRO-3 and ZeRO-0, AutoTP T=2 (number tokens in both vocabulary shards),
two data-parallel ranks, gradient accumulation, the full and the chunked head (chunks that do not divide the
tokens, micro-batches without a number token), NTL-WAS and the reweighed number-level NTL.

The global batch is fixed: data-parallel rank 0 gets only rows without number tokens, rank 1 the number-rich
rows (no hang, same update). Each Trainer's groups (`ParallelGroups`: loss, tp, dp, vocabulary) are checked
against those DeepSpeed's engine reduces over, at T=2 and dp=2 (tests/workers/trainer_step.py `check_groups`).
The cases of one world size share one launch (tests/workers/trainer_step.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.distributed import run_workers
from helpers.models import tiny_llama
from helpers.numeric import relative_error

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2400)]  # the fixture: 3 launches, 7 Trainers

WORDS = ["[UNK]", "[PAD]", "</s>", "the", "answer", "is", "plus", "minus", "times", "equals", "7", "3", "0", "9",
         "1", "5", "2", "8", "4", "6", ".", ",", "apples", "cost", "and", "of", "to", "a", "we", "get", "so", "it"]
DIGIT_IDS = list(range(10, 20))  # T=2 splits the 32 columns at 16: digits in both shards
NTL_WEIGHT, LR, WEIGHT_DECAY, BETAS, EPS = 0.5, 0.02, 0.1, (0.9, 0.95), 1e-8
CONFIG = """\
model: {{name_or_path: {root}/model, dtype: fp32, attn_implementation: eager}}
tokenizer: {{name_or_path: {root}/tokenizer}}
data:
  sources: [{{path: {root}/corpus.jsonl, text_field: text}}]
  seq_len: 16
  micro_batch_size: 4
  validation_documents: 0
loss: {{enabled: true, ntl_weight: {ntl_weight}, variant: was}}
parallel: {{tp_size: 1, zero_stage: 3}}
optim: {{lr: {lr}, weight_decay: {weight_decay}, betas: [{beta1}, {beta2}], eps: {eps}, lr_schedule: constant,
        warmup_steps: 1, grad_clip: 0.0}}
train: {{max_steps: 5, val_every_n_steps: -1, log_every_n_steps: 1}}
checkpoint: {{every_n_steps: 0, save_final: false}}
eval: {{at_end: false}}
monitor: {{progress_bar: never}}
"""
NUMBER_LEVEL = ["loss.variant=number_level", "loss.reweigh=true"]
# launch: (world size, {case: overrides}). The cases of one launch share its process group: one DeepSpeed start
# for several Trainers (DeepSpeed keeps its tensor-parallel groups for the process, so one layout per launch).
LAUNCHES = {
    "t2": (2, {
        "t2_zero3": ["parallel.tp_size=2"],
        # chunks under 32 rows take loss.chunk_backward=auto -> vocab_blocks on CPU; "rows" is named where wanted
        "t2_zero3_chunk7_rows": ["parallel.tp_size=2", "loss.chunk_tokens=7", "loss.chunk_backward=rows"],
        "t2_zero3_chunk6_number_level": ["parallel.tp_size=2", "loss.chunk_tokens=6", *NUMBER_LEVEL],
    }),
    "dp2": (2, {
        "dp2_zero3_ga2_chunk5_rows": ["data.micro_batch_size=1", "train.grad_accum_steps=2", "loss.chunk_tokens=5",
                                      "loss.chunk_backward=rows"],
        "dp2_zero0_ga2": ["parallel.zero_stage=0", "data.micro_batch_size=1", "train.grad_accum_steps=2"],
        "dp2_zero0_chunk9_number_level": ["parallel.zero_stage=0", "data.micro_batch_size=2", "loss.chunk_tokens=9",
                                          *NUMBER_LEVEL],
    }),
    "t1": (1, {
        "t1_zero3_ga2": ["data.micro_batch_size=2", "train.grad_accum_steps=2"],
    }),
}
CASES = {name: overrides for _, cases in LAUNCHES.values() for name, overrides in cases.items()}

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model, the tokenizer, the config, the fixed batch; the initial weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("trainer_step")
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="</s>")
    tokenizer.save_pretrained(root / "tokenizer")
    model = tiny_llama(len(WORDS), seed=0)
    model.save_pretrained(root / "model")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the data stream is built at start-up (then replaced by the fixed batch): a small corpus of the words
    lines = [" ".join(WORDS[3 + (i * 7 + j) % (len(WORDS) - 3)] for j in range(40)) for i in range(40)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    (root / "config.yaml").write_text(CONFIG.format(root=root, ntl_weight=NTL_WEIGHT, lr=LR, weight_decay=WEIGHT_DECAY,
                                                    beta1=BETAS[0], beta2=BETAS[1], eps=EPS))
    (root / "ds_zero3.json").write_text(json.dumps(  # no persistent parameters: the head is gathered like a big one
        {"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    generator = torch.Generator().manual_seed(1)
    words = torch.tensor([i for i, w in enumerate(WORDS) if i >= 3 and not w.isdigit()])
    tokens = words[torch.randint(0, len(words), (4, 17), generator=generator)]  # rows 0-1: no number token
    tokens[2:, ::2] = torch.randint(10, 20, (2, 9), generator=generator)  # rows 2-3: half digits
    tokens[3, 1::4] = torch.randint(10, 20, (1, 4), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[1, :3] = -100
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}
    torch.save(batch, root / "batch.pt")
    return root, tokenizer, batch, initial


def _reference(setup, number_level: bool, lrs: list[float]) -> dict:
    """One process, plain PyTorch + ntloss: the figures of the initial weights on the whole batch, and the
    weights after AdamW's steps with learning rates `lrs` (0 but the last) on that gradient."""
    import ntloss
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    root, tokenizer, batch, _ = setup
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32, attn_implementation="eager")
    logits = model(input_ids=batch["input_ids"]).logits
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    if number_level:
        ntl = ntloss.NumberLevelLoss(tokenizer, vocab_size=len(WORDS), reweigh=True)(logits, batch["labels"])
    else:
        ntl = ntloss.NTLoss(tokenizer, vocab_size=len(WORDS), digit_level=True, reweigh=False)(logits, batch["labels"])
    loss = ce + NTL_WEIGHT * ntl
    loss.backward()
    grad_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    for lr in lrs:
        optimizer.param_groups[0]["lr"] = lr
        optimizer.step()
    return {"train/ce": ce.item(), "train/ntl": ntl.item(), "train/loss": loss.item(),
            "train/grad_norm": grad_norm.item(), "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def results(setup) -> dict:
    root = setup[0]
    found = {}
    for launch, (world, cases) in LAUNCHES.items():
        cases_file = root / f"cases_{launch}.json"
        cases_file.write_text(json.dumps([
            {"name": name, "overrides": overrides + ([] if "parallel.zero_stage=0" in overrides else
                                                      [f"deepspeed.config={root / 'ds_zero3.json'}"])}
            for name, overrides in cases.items()]))
        run_workers("trainer_step.py", world, [str(root), str(root / "batch.pt"), str(root / "config.yaml"),
                                                str(cases_file)], timeout=240 + 120 * len(cases))
        for name in cases:
            found[name] = (json.loads((root / name / "result.json").read_text()), torch.load(root / name / "weights.pt"))
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_train_step_equals_the_plain_pytorch_and_ntloss_reference(setup, results, name: str):
    result, weights = results[name]
    lrs = result["lrs"]
    assert len(lrs) == 1 and lrs[0] > 0, lrs  # the first step trains (DeepSpeed's schedulers alone: two at lr 0)
    reference = _reference(setup, "loss.variant=number_level" in CASES[name], lrs)
    for figures in result["figures"]:
        for tag in ("train/ce", "train/ntl", "train/loss"):
            assert figures[tag] == pytest.approx(reference[tag], rel=1e-5), (tag, figures)
        assert figures["train/grad_norm"] == pytest.approx(reference["train/grad_norm"], rel=1e-4), figures
    initial = setup[3]
    expected_weights = reference["weights"]
    assert weights.keys() == expected_weights.keys()
    for key, expected in expected_weights.items():
        delta, expected_delta = weights[key].float() - initial[key], expected - initial[key]
        assert expected_delta.norm() > 0, f"{key} did not change: the step did nothing"
        assert relative_error(delta, expected_delta) <= 1e-3, (key, relative_error(delta, expected_delta))
