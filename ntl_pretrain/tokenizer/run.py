"""The run's tokenizer as the configuration names it: its source and config key, the small digit-level BPE the
self-contained demo trains on its corpus, and the check that a tokenizer belongs to the model it trains (the
load itself, checked against the model's config: `models.build.load_run_tokenizer`)."""

from __future__ import annotations

import os
from typing import Iterable

from ..config import ModelConfig, TokenizerConfig
from ..core.fs import atomic_directory

DEMO_EOS = "<|endoftext|>"


def tokenizer_source(tokenizer_cfg: TokenizerConfig, model_cfg: ModelConfig) -> str:
    source = tokenizer_cfg.name_or_path or model_cfg.name_or_path
    if source is None:
        raise ValueError("no tokenizer: set tokenizer.name_or_path")
    return source


def needs_training(tokenizer_cfg: TokenizerConfig, model_cfg: ModelConfig) -> bool:
    """True when the configured tokenizer folder is to be trained here (the demo) and is not there yet."""
    return tokenizer_cfg.train_vocab_size > 0 and not os.path.exists(tokenizer_source(tokenizer_cfg, model_cfg))


def train_digit_bpe(texts: Iterable[str], vocab_size: int, out_dir: str) -> str:
    """Train a byte-level BPE in which every digit is its own token and save it as a HF tokenizer folder.

    Digits are split off before the byte-level step, so "2024" is always "2","0","2","4" and the ten bare
    digit tokens exist (they are part of the byte alphabet). The folder appears complete or not at all.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"tokenizer.train_vocab_size={vocab_size} is too small: the byte alphabet alone has "
                         f"256 tokens; use at least 300")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[DEMO_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=DEMO_EOS, pad_token=DEMO_EOS)
    out_dir = os.path.abspath(out_dir)
    try:
        with atomic_directory(out_dir) as staging:
            wrapped.save_pretrained(staging)
    except FileExistsError:
        pass  # another process (a rank on another node without a shared file system) finished first: same result
    return out_dir


def tokenizer_key(tokenizer_cfg: TokenizerConfig) -> str:
    """The config key the run's tokenizer source comes from (for messages)."""
    return "tokenizer.name_or_path" if tokenizer_cfg.name_or_path else "model.name_or_path"


def check_tokenizer_matches_model(tokenizer_size: int, model_vocab_size: int, source: str, key: str,
                                  model_source: str) -> None:
    """Refuse a tokenizer with far fewer tokens than the model has embedding rows (not the model's tokenizer).

    Models pad their vocabulary by at most a few hundred rows (Qwen2.5: 151 665 tokens, 151 936 rows), and
    a tokenizer that gained tokens is larger, which resizing handles; under half the rows is another tokenizer.
    """
    if tokenizer_size * 2 < model_vocab_size:
        raise ValueError(
            f"{key}={source!r} has {tokenizer_size} tokens, far fewer than the {model_vocab_size} embedding rows of "
            f"model.name_or_path={model_source!r}: it is not this model's tokenizer (or a broken file). Use the "
            f"model's own tokenizer, or its conversion from: python tools/tokenizer.py split-digits MODEL_TOKENIZER OUT")
