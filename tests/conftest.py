"""Shared fixtures: tokenizers built in the test session (nothing downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Multi-process tests oversubscribe 2 cores unless each process runs one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

NUMBER_RICH_CORPUS = [
    "In 2024 the shop sold 12345 apples for 3.50 dollars each.",
    "Add 17 and 25 to get 42; subtract 9 from 100 to get 91.",
    "The train left at 10:45 and arrived 3 hours later, covering 287 km.",
    "Call 555-0199 or write to Room 404, floor 7.",
    "She counted 1, 2, 3, 4, 5, 6, 7, 8, 9, 0 and then 10 20 30 40 50 60 70 80 90.",
    "A total of 98765 people, or 12.5 percent, voted on 2023-11-05.",
] * 8


def build_word_level_tokenizer():
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


def build_byte_level_bpe_tokenizer(vocab_size: int = 400):
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


DEEPSPEED_SHM_PREFIX = "/dev/shm/deepspeed_allreduce_buffer_"


def _mapped_files() -> set[str]:
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[-1].strip() for line in maps.read_text().splitlines()
                          if DEEPSPEED_SHM_PREFIX in line)
        except OSError:  # the process ended while we read
            continue
    return mapped


@pytest.fixture(autouse=True)
def _remove_own_deepspeed_shm():
    """DeepSpeed's CPU all-reduce leaves a 66 MiB buffer per rank in /dev/shm (RAM) when its processes
    exit; a suite of multi-process tests would pile up gigabytes. Remove the unmapped buffers of the
    ports this test session handed out (tests/distributed.free_port), and no one else's."""
    from distributed import PORTS_USED

    yield
    in_use = _mapped_files()
    for port in list(PORTS_USED):
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            if str(path) not in in_use:
                path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def word_tokenizer():
    return build_word_level_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return build_byte_level_bpe_tokenizer()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data folder {SHARED_DATA} is absent: the tests need ../shared/data beside the clone")
    return SHARED_DATA
