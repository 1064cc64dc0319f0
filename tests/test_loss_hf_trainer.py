"""`HFTrainerLoss` in a real `transformers.Trainer` run (tiny Llama, CPU, gradient accumulation 2) against the
references: transformers' own causal-LM loss, and transformers' CE plus plain `ntloss`."""

from __future__ import annotations

import ntloss
import pytest
import torch
import torch.nn.functional as F

from helpers.variants import LARGE_TERM_OPTIONS, ROW_LOCAL_OPTIONS, one_variant_of_each_kind, variant_settings
from ntl_pretrain.loss import HFTrainerLoss, NTLSettings
from ntl_pretrain.numbers import NumberVocab

STEPS, MICRO_BATCH, ACCUMULATION = 3, 2, 2


def _texts() -> list[str]:
    # rows of different lengths (padding, so micro-batches hold different token counts) and number densities
    return [f"q: {a}+{b}={a + b}" + " ok" * (a % 4) for a, b in zip(range(7, 90, 7), range(3, 60, 5))]


def _train(tokenizer, compute_loss_func, tmp_path) -> list[float]:
    """The loss of every micro-batch of a short Trainer run (what compute_loss returned, in order)."""
    from datasets import Dataset
    from helpers.models import tiny_llama
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    recorded: list[float] = []
    model = tiny_llama(len(tokenizer), seed=0, pad_token_id=tokenizer.pad_token_id).train()
    data = Dataset.from_dict({"text": _texts()}).map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=MICRO_BATCH,
                             gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=5e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             dataloader_drop_last=True, disable_tqdm=True)

    class Recording(Trainer):
        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            recorded.append(float(loss.detach()))
            return loss

    Recording(model=model, args=args, train_dataset=data, compute_loss_func=compute_loss_func,
              data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
    assert len(recorded) == STEPS * ACCUMULATION
    return recorded


@pytest.fixture(scope="module")
def tokenizer():
    from helpers.models import char_tokenizer

    return char_tokenizer()


def test_ce_only_equals_transformers_causal_lm_loss(tokenizer, tmp_path):
    # ntl_weight 0: the model's own loss (shifted labels, normalised by num_items_in_batch) on every micro-batch
    ours = _train(tokenizer, HFTrainerLoss(NumberVocab.from_tokenizer(tokenizer), ntl_weight=0.0), tmp_path / "a")
    reference = _train(tokenizer, None, tmp_path / "b")
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reweigh", [False, True])
def test_ce_plus_ntl_equals_transformers_ce_plus_ntloss(tokenizer, tmp_path, reweigh):
    from transformers.loss.loss_utils import ForCausalLMLoss

    weight = 0.3
    reference_ntl = ntloss.NTLoss(tokenizer, reweigh=reweigh)

    def reference(outputs, labels, num_items_in_batch=None):
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        ce = ForCausalLMLoss(outputs.logits, labels, len(tokenizer), num_items_in_batch=num_items_in_batch)
        ntl = reference_ntl(outputs.logits.float(), shifted)
        # the documented normalisation: each micro-batch's NTL mean weighted by its share of the step's tokens
        return ce + weight * ntl * shifted.ne(-100).sum() / num_items_in_batch

    number_vocab = NumberVocab.from_tokenizer(tokenizer)
    ours = _train(tokenizer, HFTrainerLoss(number_vocab, ntl_weight=weight, settings=NTLSettings(reweigh=reweigh)),
                  tmp_path / "a")
    expected = _train(tokenizer, reference, tmp_path / "b")
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_without_num_items_is_the_batch_mean_of_shifted_labels(tokenizer):
    from helpers.models import tiny_llama
    from ntl_pretrain.loss import ce_ntl_loss

    number_vocab = NumberVocab.from_tokenizer(tokenizer)
    model = tiny_llama(len(tokenizer))
    batch = tokenizer(_texts()[:2], padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    outputs = model(**batch)
    loss = HFTrainerLoss(number_vocab, model=model)(outputs, labels)
    expected = ce_ntl_loss(outputs.logits[:, :-1], labels[:, 1:], number_vocab)
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="needs labels"):
        HFTrainerLoss(number_vocab)(outputs, None)


def _one_step_update(tokenizer, tmp_path, micro_batch: int, accumulation: int, attach: bool,
                     settings: NTLSettings) -> tuple[float, dict]:
    """One optimizer step of a real Trainer over the same 8 padded rows of different number densities, as
    `micro_batch` x `accumulation`: (the logged loss, every parameter's change). Plain SGD at lr 1, no clipping:
    the change is minus the step's gradient."""
    from datasets import Dataset
    from helpers.models import tiny_llama
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    texts = ["q: 12+30=42 and 7+8=15", "no numbers in this row at all, only words here", "1 2 3 4 5 6 7 8 9",
             "a 5", "9999+1=10000", "the cat sat on the mat by the door", "x 31 y 47", "77"]
    model = tiny_llama(len(tokenizer), seed=0, pad_token_id=tokenizer.pad_token_id).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = Dataset.from_dict({"text": texts}).map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    args = TrainingArguments(output_dir=str(tmp_path / f"{micro_batch}x{accumulation}"), optim="sgd",
                             learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                             per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
                             max_steps=1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True)
    loss = HFTrainerLoss(NumberVocab.from_tokenizer(tokenizer), model=model, ntl_weight=0.5, settings=settings)
    trainer = Trainer(model=model, args=args, train_dataset=data, compute_loss_func=loss,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    if attach:
        assert loss.attach(trainer) is loss
    trainer.train()
    logged = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    return float(logged), {name: (p.detach() - before[name]) for name, p in model.named_parameters()}


# one variant of each kind (from the registry); del's runs per row: the rows end and start with digits, which its
# default (the authors' runs over the flattened micro-batch) would join differently in 8 x 1 and 2 x 4; c = 1 so that
# the term moves the update
@pytest.mark.parametrize("settings", [variant_settings(variant, ROW_LOCAL_OPTIONS, LARGE_TERM_OPTIONS)
                                      for variant in one_variant_of_each_kind()], ids=lambda s: s.variant)
def test_attached_loss_does_not_change_with_gradient_accumulation(tokenizer, tmp_path, settings):
    """Issue 35: 8 rows as 8 x 1 and as 2 x 4 micro-batches give the same loss and update (1e-6) once the loss is
    attached (the step's NTL terms count). Not attached, each micro-batch's NTL mean is weighted by its label
    tokens and the update differs (the rows' number densities differ): the comparison can fail."""
    whole_loss, whole = _one_step_update(tokenizer, tmp_path, 8, 1, True, settings)
    split_loss, split = _one_step_update(tokenizer, tmp_path, 2, 4, True, settings)
    assert split_loss == pytest.approx(whole_loss, rel=1e-6, abs=1e-6)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
    _, unattached = _one_step_update(tokenizer, tmp_path, 2, 4, False, settings)
    worst = max(float((unattached[n] - whole[n]).abs().max() / whole[n].abs().max().clamp_min(1e-12)) for n in whole)
    assert worst > 1e-3, worst


@pytest.mark.fast
@pytest.mark.parametrize("side", ["left", "right"])
def test_left_padding_targets_are_masked_so_accumulation_keeps_the_gradient(tokenizer, side):
    """Issue 47: with LEFT padding, transformers' collator keeps each padded row's first real token as a target
    predicted from a pad position, so the step's targets and gradient depend on how its rows are split into
    micro-batches (8 rows as 1 x 8 against 8 x 1: one more target per padded row); `without_targets_after_padding`
    removes them, and changes nothing with right padding. CE normalised by the step's targets, as the Trainer does."""
    import copy

    from helpers.models import tiny_llama
    from transformers import DataCollatorForLanguageModeling

    from ntl_pretrain.loss import without_targets_after_padding

    padded = copy.deepcopy(tokenizer)
    padded.padding_side = side
    rows = [padded(text) for text in _texts()[:8]]
    model = tiny_llama(len(padded), seed=0, pad_token_id=padded.pad_token_id)

    def step(collate, micro_batches: int) -> tuple[int, torch.Tensor]:
        model.zero_grad()
        size = len(rows) // micro_batches
        batches = [collate(rows[i:i + size]) for i in range(0, len(rows), size)]
        targets = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in batches)  # num_items_in_batch
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum",
                            ignore_index=-100).div(targets).backward()
        return targets, torch.cat([p.grad.flatten() for p in model.parameters()])

    collator = DataCollatorForLanguageModeling(padded, mlm=False)
    masked = without_targets_after_padding(collator)
    (whole_targets, whole), (split_targets, split) = step(masked, 1), step(masked, 8)
    assert whole_targets == split_targets == sum(len(row["input_ids"]) - 1 for row in rows)
    torch.testing.assert_close(whole, split, rtol=1e-4, atol=1e-6)
    plain_targets, plain = step(collator, 1)
    lengths = [len(row["input_ids"]) for row in rows]
    padded_rows = sum(length < max(lengths) for length in lengths)
    if side == "left":  # each padded row's first token became a target; the gradient is another
        assert plain_targets == whole_targets + padded_rows and padded_rows > 0
        assert float((plain - split).norm() / split.norm()) > 1e-2
    else:
        assert plain_targets == whole_targets
        torch.testing.assert_close(plain, whole, rtol=1e-4, atol=1e-6)
