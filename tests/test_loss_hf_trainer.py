"""`HFTrainerLoss` in a real `transformers.Trainer` run (tiny Llama, CPU, gradient accumulation 2) against the
references: transformers' own causal-LM loss, and transformers' CE plus plain `ntloss`."""

from __future__ import annotations

import ntloss
import pytest
import torch
import torch.nn.functional as F

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
