"""The number vocabulary of real and test-built tokenizers, and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from ntl_pretrain.numbers import NumberVocab

pytestmark = pytest.mark.fast


class _Tokenizer:
    """A tokenizer-like object with just `get_vocab` and `len`."""

    name_or_path = "toy"

    def __init__(self, tokens):
        self.vocab = {token: index for index, token in enumerate(tokens)}

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


def test_digit_level_on_byte_level_bpe_ignores_space_marked_digits(bpe_tokenizer):
    vocab = NumberVocab.from_tokenizer(bpe_tokenizer)
    assert vocab.tokens == tuple("0123456789") and vocab.values == tuple(float(d) for d in range(10))
    assert all(bpe_tokenizer.convert_ids_to_tokens(i) in "0123456789" for i in vocab.token_ids)
    assert "Ġ5" in bpe_tokenizer.get_vocab() or "Ġ1" in bpe_tokenizer.get_vocab()  # such tokens exist ...
    assert not any(t.startswith("Ġ") for t in vocab.tokens)  # ... and are not number tokens


def test_multi_digit_mode_takes_every_finite_number(word_tokenizer):
    vocab = NumberVocab.from_tokenizer(word_tokenizer, digit_level=False)
    assert dict(zip(vocab.tokens, vocab.values)) == {**{str(d): float(d) for d in range(10)}, "12": 12.0, "3.5": 3.5,
                                                    "100": 100.0, "-7": -7.0}
    assert list(vocab.token_ids) == sorted(vocab.token_ids)


def test_real_gpt2_and_llama2_tokenizers(shared_data, tmp_path):
    from transformers import AutoTokenizer

    gpt2 = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "gpt2")
    assert NumberVocab.from_tokenizer(gpt2).token_ids == tuple(range(15, 25))
    (tmp_path / "llama2").mkdir()
    (tmp_path / "llama2" / "tokenizer.model").symlink_to(shared_data / "tokenizers" / "llama2" / "tokenizer.model")
    (tmp_path / "llama2" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    llama = AutoTokenizer.from_pretrained(tmp_path / "llama2")
    vocab = NumberVocab.from_tokenizer(llama)
    expected = {0: 29900, 1: 29896, 2: 29906, 3: 29941, 4: 29946, 5: 29945, 6: 29953, 7: 29955, 8: 29947, 9: 29929}
    assert {int(v): i for i, v in zip(vocab.token_ids, vocab.values)} == expected


def test_save_and_load_round_trip(word_tokenizer, tmp_path):
    vocab = NumberVocab.from_tokenizer(word_tokenizer, vocab_size=64)
    path = vocab.save(tmp_path)
    assert path.endswith("number_vocab.json")
    assert NumberVocab.load(tmp_path) == vocab
    assert NumberVocab.load(path).decimal_point_id == word_tokenizer.convert_tokens_to_ids(".")


def test_index_of_maps_labels_to_number_slots():
    vocab = NumberVocab(token_ids=(2, 5, 7), values=(1.0, 2.0, 3.0), vocab_size=10)
    labels = torch.tensor([2, 3, 5, 7, -100, 9])
    assert vocab.index_of(labels).tolist() == [0, -1, 1, 2, -1, -1]


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="has no bare digit tokens.*split-digits"):
        NumberVocab.from_tokenizer(_Tokenizer(["a", "b", "Ġ1", "▁2"]))
    with pytest.raises(ValueError, match=r"missing \['3', '8'\]"):
        NumberVocab.from_tokenizer(_Tokenizer(["a"] + [d for d in "0123456789" if d not in "38"]))
    with pytest.raises(ValueError, match="every token of tokenizer 'toy' is a number"):
        NumberVocab.from_tokenizer(_Tokenizer(list("0123456789")))
    with pytest.raises(ValueError, match="vocab_size=5 is smaller than the tokenizer's vocabulary"):
        NumberVocab.from_tokenizer(_Tokenizer(["a"] + list("0123456789")), vocab_size=5)
    with pytest.raises(ValueError, match="strictly increasing"):
        NumberVocab(token_ids=(3, 2), values=(0.0, 1.0), vocab_size=10)
    with pytest.raises(FileNotFoundError, match="no number vocabulary"):
        NumberVocab.load(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not a number vocabulary object"):
        NumberVocab.load(tmp_path / "list.json")
    (tmp_path / "nan.json").write_text(json.dumps({"token_ids": [1, 2], "values": ["nan", 1], "vocab_size": 5}))
    with pytest.raises(ValueError, match=r"nan.json' is not a valid number vocabulary: .*finite"):
        NumberVocab.load(tmp_path / "nan.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid number-vocabulary JSON"):
        NumberVocab.load(tmp_path / "bad.json")


def test_multi_digit_number_tokens_are_ascii_decimals_not_whatever_float_reads():
    """float() (and so ntloss) reads '1_000', '1e5', '+5', ' 12', Arabic-Indic and full-width digits as numbers; a
    number token is an optional '-' and ASCII digits with at most one '.' (docs/tokenizer.md)."""
    numbers = ["12", "3.5", "-7", "007", ".5", "5."]
    lookalikes = ["1_000", "1e5", "+5", " 12", "٣", "３", "１", "1.2.3", "--1", "nan", "-inf", "Ġ12", "½", ".", "-"]
    assert all(_float_reads(token) for token in lookalikes if token not in ("½", "Ġ12", "1.2.3", "--1", ".", "-"))
    vocab = NumberVocab.from_tokenizer(_Tokenizer(["a"] + numbers + lookalikes), digit_level=False)
    assert dict(zip(vocab.tokens, vocab.values)) == {token: float(token) for token in numbers}


def _float_reads(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def test_added_tokens_that_hide_digits_are_refused_at_start_up(tmp_path, caplog):
    from transformers import AddedToken, AutoTokenizer

    from ntl_pretrain.config import load_config
    from ntl_pretrain.tokenizer.run import train_digit_bpe
    from ntl_pretrain.trainer.preflight import number_vocab_for
    from ntl_pretrain.trainer.training_objective import Objective

    train_digit_bpe([f"in {1990 + i} we sold {i * 7} apples" for i in range(40)], vocab_size=300,
                    out_dir=str(tmp_path / "tok"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    clean = tokenizer("in 2007").input_ids
    tokenizer.add_tokens(["07", "v2x"])
    tokenizer.add_tokens([AddedToken("<extra_id_12>", special=True)], special_tokens=True)
    hidden = tokenizer("in 2007").input_ids  # the added token wins over the digit split: '0' '7' are gone
    assert tokenizer.convert_tokens_to_ids("07") in hidden and hidden != clean

    def vocab_for(*overrides: str):
        cfg = load_config(None, ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok",
                                 "data.sources.0.path=c.jsonl", *overrides])
        return number_vocab_for(cfg, Objective.from_config(cfg.loss), tokenizer)

    with pytest.raises(ValueError) as info:
        vocab_for()
    message = str(info.value)
    assert "1 added token(s) that begin or end with a digit ('07')" in message and "\n" not in message
    assert "tokenizer.digit_level=false" in message and "tokenizer.allow_non_digit_level=true" in message
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        assert vocab_for("tokenizer.allow_non_digit_level=true").tokens == tuple("0123456789")
    assert "'07'" in caplog.text
    assert vocab_for("loss.enabled=false").tokens  # CE only: nothing to hide from
    assert "07" in vocab_for("tokenizer.digit_level=false").tokens  # multi-digit NTL: a number token itself


@pytest.mark.parametrize("rule, word", [("seven", "seven"), ("every digit", "0")])
def test_a_tokenizer_whose_normalizer_rewrites_digits_is_refused(rule, word):
    """A normalizer that turns '7' into 'seven' (or every digit into '0', as some corpora mask numbers) leaves the ten
    digit tokens in the vocabulary but no digit ever reaches them: NTL would act on nothing. Refused, naming the
    digit and the tokenizer.json rule; the same tokenizer without the rule is accepted."""
    from tokenizers import Regex, normalizers

    from helpers.models import char_tokenizer
    from ntl_pretrain.core.numbers import DigitsNotKeptError

    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz 0123456789")
    NumberVocab.from_tokenizer(tokenizer)  # the digits survive: accepted
    backend = tokenizer.backend_tokenizer
    backend.normalizer = (normalizers.Replace("7", word) if rule == "seven"
                          else normalizers.Replace(Regex("[1-9]"), word))
    with pytest.raises(DigitsNotKeptError, match=r"does not keep digits: '[17]' .* decodes to '(seven|0)'.* "
                                               r"rewrites or drops '[17]'.*normalizer / pre_tokenizer"):
        NumberVocab.from_tokenizer(tokenizer)
