"""CE + Number Token Loss in the Hugging Face `Trainer`, end to end on CPU in about a minute.

    python examples/hf_trainer.py [--output-dir DIR] [--max-steps N] [--grad-accum K]

Everything is built here: a number-rich corpus ("12+30=42"), a byte-level BPE that splits every digit into its own
token (NTL needs the ten digit tokens), a tiny Llama, and a `Trainer` whose `compute_loss_func` is `HFTrainerLoss`.
Swap in your model, tokenizer and dataset; the four lines marked NTL are all a training script needs.
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Trainer, TrainingArguments)

from ntl_pretrain.loss import HFTrainerLoss, NTLSettings, without_targets_after_padding
from ntl_pretrain.numbers import NumberVocab


def arithmetic_corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{a}+{b}={a + b}" for a, b in ((rng.randint(0, 999), rng.randint(0, 999)) for _ in range(n))]


def digit_bpe(texts: list[str], vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE in which every digit is its own token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                             show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=None, help="the Trainer's output folder (default: a temporary one)")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--grad-accum", type=int, default=2)
    args = parser.parse_args(argv)

    texts = arithmetic_corpus(2000)
    tokenizer = digit_bpe(texts)
    data = Dataset.from_dict({"text": texts}).map(
        lambda batch: tokenizer(batch["text"], truncation=True, max_length=32), batched=True, remove_columns=["text"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=tokenizer.eos_token_id))

    number_vocab = NumberVocab.from_tokenizer(tokenizer)  # NTL: the ten digit tokens and their values
    loss = HFTrainerLoss(number_vocab, model=model, ntl_weight=0.3, settings=NTLSettings(variant="was"))  # NTL
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(output_dir=args.output_dir or scratch, max_steps=args.max_steps,
                                     per_device_train_batch_size=16, gradient_accumulation_steps=args.grad_accum,
                                     learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=5,
                                     save_strategy="no", report_to=[], use_cpu=True, seed=0)
        # with tokenizer.padding_side="left" the collator would keep each padded row's first token as a target
        # predicted from a pad, and accumulation would change the gradient: the wrapper drops those targets
        collator = without_targets_after_padding(DataCollatorForLanguageModeling(tokenizer, mlm=False))
        trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=collator,
                          compute_loss_func=loss)  # NTL
        loss.attach(trainer)  # NTL: its mean over the whole accumulated step (gradient accumulation invariant)
        result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"trained {result.global_step} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f} (CE + 0.3 x NTL)")
    return {"steps": result.global_step, "losses": losses}


if __name__ == "__main__":
    main()
