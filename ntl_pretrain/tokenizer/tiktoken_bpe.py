"""tiktoken BPE files (Meta's Llama-3 `tokenizer.model`, OpenAI's `*.tiktoken`): recognised and converted to a
fast tokenizer with transformers' own `TikTokenConverter`.

A tiktoken file is text, one `base64(token bytes) rank` per line; a SentencePiece model is a protobuf. The
ranks are read here, not with `tiktoken.load.load_tiktoken_bpe` (which the converter calls by default):
that function caches every file it reads under the file's PATH in a shared temporary folder, so a file
replaced in place would be converted from its stale copy, and anyone who can write that folder chooses
the vocabulary.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from pathlib import Path

from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.tokenization_utils_tokenizers import TokenizersBackend

TIKTOKEN_SUFFIXES = (".model", ".tiktoken")
_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+")

# Meta's Llama 3 reference tokenizer appends 256 special tokens to its 128,000 ranks (ids 128000..128255);
# the file does not hold them. Llama 3.1 and later rename a few reserved slots; the ids below keep their meaning.
_LLAMA3_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
# Special tokens (and the bos / eos among them) of known tiktoken vocabularies, by their number of ranks.
KNOWN_SPECIAL_TOKENS: dict[int, tuple[list[str], str, str]] = {
    128000: (LLAMA3_SPECIAL_TOKENS, "<|begin_of_text|>", "<|end_of_text|>"),
}


def is_tiktoken_bpe(path: str | os.PathLike) -> bool:
    """Whether the file's first line has the tiktoken form `base64 rank` (a SentencePiece model never does)."""
    with open(path, "rb") as file:
        first = file.readline(4096).rstrip(b"\r\n")
    return _LINE.fullmatch(first) is not None


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """The token bytes -> rank table of a tiktoken file; a malformed line is an error naming it."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            line = line.rstrip(b"\r\n")
            if not line:
                continue
            try:
                if not _LINE.fullmatch(line):
                    raise ValueError("not 'base64 rank'")
                token, rank = line.split(b" ")
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as error:
                raise ValueError(f"{str(path)!r} line {number} is not a tiktoken 'base64 rank' line ({error}): the "
                                 f"file is not a valid tiktoken BPE file") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{str(path)!r}: the ranks of the tiktoken file are not 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{str(path)!r}: the tiktoken file lacks some of the 256 single bytes, so not every text "
                         f"can be encoded")
    return ranks


class _FileConverter(TikTokenConverter):
    """transformers' converter, reading the ranks with `read_ranks` (no path-keyed cache)."""

    load_tiktoken_bpe = staticmethod(read_ranks)


def load_tiktoken_file(path: str | os.PathLike) -> TokenizersBackend:
    """A fast tokenizer from a tiktoken BPE file (transformers' `TikTokenConverter`, its default pre-tokenizer
    pattern, which is Llama 3's). The special tokens of a known vocabulary (Llama 3's 128,000 ranks) are
    appended as the reference tokenizer does; other files get none."""
    ranks = read_ranks(path)
    specials, bos, eos = KNOWN_SPECIAL_TOKENS.get(len(ranks), ([], None, None))
    backend = _FileConverter(vocab_file=str(path), extra_special_tokens=specials).converted()
    tokenizer = TokenizersBackend(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.name_or_path = str(Path(path))
    return tokenizer
