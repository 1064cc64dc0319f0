"""tiktoken BPE files (Meta's Llama-3 `tokenizer.model` format): recognised by every tokenizer path and converted
to a fast tokenizer that encodes like `tiktoken` itself."""

from __future__ import annotations

import base64
import itertools
import json
from pathlib import Path

import pytest
import tiktoken

from ntl_pretrain.tokenizer import load_tokenizer
from ntl_pretrain.tokenizer.loading import TokenizerLoadError
from ntl_pretrain.tokenizer.tiktoken_bpe import LLAMA3_SPECIAL_TOKENS

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = ["In 2024 the shop sold 12345 apples for 3.50 dollars each.", "Add 17 and 25 to get 42; 1000000 - 9 = 999991",
         "Über 7 Brücken, 日本 1 2 3\n\n  tabs\tand 'll 's", "x=0.125, y=-7e5 #### 72"]


def _write(path: Path, ranks: dict[bytes, int]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(token) + b" " + str(rank).encode() + b"\n"
                              for token, rank in sorted(ranks.items(), key=lambda item: item[1])))
    return path


def _trained_ranks(bpe_tokenizer) -> dict[bytes, int]:
    """The byte-level BPE trained in the session as tiktoken ranks: its merges in order, over the 256 bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab = json.loads(bpe_tokenizer.backend_tokenizer.to_str())["model"]["vocab"]
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
        if token.startswith("<|"):
            continue
        ranks.setdefault(bytes(byte_of[char] for char in token), len(ranks))
    return ranks


def _reference(ranks: dict[bytes, int], specials: dict[str, int] | None = None) -> tiktoken.Encoding:
    return tiktoken.Encoding("test", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials or {})


def test_a_tiktoken_file_encodes_like_tiktoken_everywhere_a_path_is_taken(bpe_tokenizer, tmp_path):
    ranks = _trained_ranks(bpe_tokenizer)
    model = _write(tmp_path / "tokenizer.model", ranks)
    folder = tmp_path / "original"
    folder.mkdir()
    _write(folder / "tokenizer.model", ranks)
    reference = _reference(ranks)
    for source in (model, folder, _write(tmp_path / "cl.tiktoken", ranks)):
        tokenizer = load_tokenizer(source)
        assert len(tokenizer) == len(ranks)
        for text in TEXTS:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert ids == reference.encode(text), (source, text)
            assert tokenizer.decode(ids) == text


def test_tools_and_trainer_take_meta_llama3_tokenizer_model(tmp_path, capsys):
    import sys

    from ntl_pretrain.config import ModelConfig, TokenizerConfig
    from ntl_pretrain.models.build import load_run_tokenizer as trainer_load_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import tokenizer as tool

    # Llama 3's shape: 128,000 ranks (every byte, then merges of lower ranks), its special tokens appended
    ranks = {bytes([b]): b for b in range(256)}
    printable = [bytes([b]) for b in range(32, 127)]
    for left, right in itertools.product(printable, repeat=2):
        ranks[left + right] = len(ranks)
    for pair, byte in itertools.product(list(ranks)[256:], printable):
        if len(ranks) == 128000:
            break
        ranks[pair + byte] = len(ranks)
    folder = tmp_path / "Meta-Llama-3-8B" / "original"
    folder.mkdir(parents=True)
    _write(folder / "tokenizer.model", ranks)
    tokenizer = trainer_load_tokenizer(TokenizerConfig(name_or_path=str(folder)), ModelConfig())
    specials = {token: 128000 + index for index, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id) == (128256, 128001, 128000)
    assert tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|reserved_special_token_250|>"]) == [128009, 128255]
    text = "<|begin_of_text|>Add 17 and 25 to get 42<|eot_id|>"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == _reference(ranks, specials).encode(
        text, allowed_special="all")
    assert tool.main(["inspect", str(folder / "tokenizer.model")]) == 0
    assert "SentencePiece" not in capsys.readouterr().err


def test_a_broken_tiktoken_file_is_named_with_its_line(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    model = _write(tmp_path / "tokenizer.model", ranks)
    model.write_bytes(model.read_bytes() + b"QUJD notanumber\n")
    with pytest.raises(TokenizerLoadError, match=r"line 257 is not a tiktoken 'base64 rank' line"):
        load_tokenizer(model)
    _write(model, {bytes([b]): b for b in range(255)})
    with pytest.raises(TokenizerLoadError, match="lacks some of the 256 single bytes"):
        load_tokenizer(model)


def test_split_digits_of_a_tiktoken_file_says_each_phase_as_it_starts(bpe_tokenizer, tmp_path, capsys):
    """Issue 36 item 5: split-digits on a large tiktoken file ran a minute without a line; each phase is now one
    stderr line with the seconds since the start (stdout keeps the report)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import tokenizer as tool

    model = _write(tmp_path / "cl.tiktoken", _trained_ranks(bpe_tokenizer))
    assert tool.main(["split-digits", str(model), str(tmp_path / "out"), "--json"]) == 0
    captured = capsys.readouterr()
    phases = [line.split("] ", 1)[1] for line in captured.err.splitlines() if line.startswith("[")]
    assert [phase.split(" ")[0] for phase in phases] == ["loading", "loaded", "writing", "verifying"], captured.err
    assert "a tiktoken file: its merges are derived from its ranks first" in phases[0]
    assert json.loads(captured.out)["verification"]["passed"] is True
