"""Tiny models and tokenizer stand-ins built in the test process (nothing downloaded)."""

from __future__ import annotations

import torch

NUMBER_RICH_CORPUS = [
    "In 2024 the shop sold 12345 apples for 3.50 dollars each.",
    "Add 17 and 25 to get 42; subtract 9 from 100 to get 91.",
    "The train left at 10:45 and arrived 3 hours later, covering 287 km.",
    "Call 555-0199 or write to Room 404, floor 7.",
    "She counted 1, 2, 3, 4, 5, 6, 7, 8, 9, 0 and then 10 20 30 40 50 60 70 80 90.",
    "A total of 98765 people, or 12.5 percent, voted on 2023-11-05.",
] * 8

EVAL_CHARS = "0123456789+-*=.,$ \nabcdefghijklmnopqrstuvwxyzQA:?#"


def tiny_llama_config(vocab_size: int, **overrides):
    """A Llama config small enough for CPU tests: 2 layers, hidden 32, 4 heads and 2 key-value heads
    (shardable over 2 TP ranks), untied head; `overrides` are LlamaConfig fields."""
    from transformers import LlamaConfig

    settings = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaConfig(vocab_size=vocab_size, **{**settings, **overrides})


def tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    """`tiny_llama_config(vocab_size, **overrides)` initialised from `seed`, in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab_size, **overrides)).eval()


def eval_llama(vocab_size: int, seed: int = 0, initializer_range: float = 0.02, max_positions: int = 256):
    """The evaluation tests' model: hidden 64, </s>=1 ends generation, <pad>=0 (as `char_tokenizer`)."""
    return tiny_llama(vocab_size, seed, hidden_size=64, intermediate_size=128, max_position_embeddings=max_positions,
                      initializer_range=initializer_range, bos_token_id=None, eos_token_id=1, pad_token_id=0)


def char_tokenizer(chars: str = EVAL_CHARS, bos: bool = False):
    """One token per character (digits are single tokens), with <pad>=0 and </s>=1; with `bos`, a Llama-style
    <s>=3 that the default encoding prepends (a TemplateProcessing post-processor)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **({"<s>": 3} if bos else {})}
    for char in chars:
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                   **({"bos_token": "<s>"} if bos else {}))


def word_level_tokenizer():
    """A word-level tokenizer whose vocabulary holds words, the ten digits and a few multi-digit numbers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "the", "answer", "is", "plus", "minus", "times", "equals", ".", ",", "apples",
             "cost", "and", "12", "3.5", "100", "-7", "nan", "inf"]
    vocab = {}
    for token in words[:5] + [str(d) for d in (7, 3, 0, 9, 1, 5, 2, 8, 4, 6)] + words[5:]:
        vocab[token] = len(vocab)
    model = models.WordLevel(vocab=vocab, unk_token="[UNK]")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")


def byte_level_bpe_tokenizer(vocab_size: int = 400):
    """A GPT-2-style byte-level BPE trained on a number-rich corpus: numbers merge into multi-digit
    tokens and digits also exist with the space marker ("Ġ5")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(NUMBER_RICH_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def zero3_autotp_engine(model, tp_size: int):
    """`model` in a DeepSpeed ZeRO-3 engine with AutoTP at `tp_size` and the vocabulary-parallel head (the data-parallel
    size is what the world leaves), as the evaluation workers run it; the engine."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "tensor_parallel": {"autotp_size": tp_size, "vocab_parallel_lm_head": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine
