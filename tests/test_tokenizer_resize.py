"""Resizing a model's embeddings after split-digits added a digit token: tied and untied heads."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from helpers.models import tiny_llama
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.tokenizer import load_tokenizer, resize_model_embeddings, split_digits

from test_tokenizer_families import build_spm

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[1]
DIGIT_FREE_TEXT = "Ann walked the miles and bought apples, then the books."


def _without_bare_seven(folder: Path, out: Path) -> Path:
    """A SentencePiece unigram tokenizer that has "▁7" but lost the bare "7" (as with character_coverage < 1)."""
    tokenizer = load_tokenizer(folder)
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    pieces = [piece for piece, _score in data["model"]["vocab"]]
    assert "▁7" in pieces, "the corpus should make '▁7' a piece"
    data["model"]["vocab"][pieces.index("7")][0] = "<no-bare-seven>"
    TokenizersBackend(tokenizer_object=Tokenizer.from_str(json.dumps(data)), unk_token="<unk>", bos_token="<s>",
                      eos_token="</s>").save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tokenizers_before_after(tmp_path_factory):
    root = tmp_path_factory.mktemp("resize")
    source = _without_bare_seven(build_spm(root / "spm", split_digits=False), root / "no7")
    report = split_digits(source, root / "split")
    assert report.added_digits and list(report.added_digits) == ["7"]
    return load_tokenizer(source), load_tokenizer(root / "split"), root


def _tiny_llama(vocab_size: int, tied: bool, seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(vocab_size, seed, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [True, False])
def test_resize_keeps_logits_and_initialises_new_rows(tied, tokenizers_before_after):
    before, after, _root = tokenizers_before_after
    model = _tiny_llama(len(before), tied)
    old_input = model.get_input_embeddings().weight.detach().clone()
    old_output = model.get_output_embeddings().weight.detach().clone()
    ids = after.encode(DIGIT_FREE_TEXT, add_special_tokens=False)
    assert ids == before.encode(DIGIT_FREE_TEXT, add_special_tokens=False)
    with torch.no_grad():
        logits_before = model(torch.tensor([ids])).logits

    report = resize_model_embeddings(model, after, pad_to_multiple_of=16)

    new_rows = -(-len(after) // 16) * 16
    assert (report.old_rows, report.new_rows, report.tokenizer_size) == (len(before), new_rows, len(after))
    assert model.config.vocab_size == new_rows
    seven, spaced_seven = after.convert_tokens_to_ids("7"), after.convert_tokens_to_ids("▁7")
    assert report.new_token_ids == [seven] and report.copied_from == {"7": "▁7"}
    assert report.padding_rows == new_rows - len(after) and report.tied is tied
    input_weight = model.get_input_embeddings().weight
    output_weight = model.get_output_embeddings().weight
    assert input_weight.shape[0] == output_weight.shape[0] == new_rows
    assert (output_weight is input_weight) is tied
    assert torch.isfinite(input_weight).all() and torch.isfinite(output_weight).all()
    # old rows untouched; the new digit copies its other spelling; padding rows are the old mean
    assert torch.equal(input_weight[:len(before)], old_input)
    assert torch.equal(input_weight[seven], old_input[spaced_seven])
    assert torch.allclose(input_weight[len(after):], old_input.mean(dim=0).expand(new_rows - len(after), -1))
    if not tied:
        assert torch.equal(output_weight[:len(before)], old_output)
        assert torch.equal(output_weight[seven], old_output[spaced_seven])
        assert torch.allclose(output_weight[len(after):], old_output.mean(dim=0).expand(new_rows - len(after), -1))
    with torch.no_grad():
        logits_after = model(torch.tensor([ids])).logits
    assert logits_after.shape[-1] == new_rows
    torch.testing.assert_close(logits_after[..., :len(before)], logits_before, rtol=0, atol=0)
    assert torch.isfinite(logits_after).all()
    # NTL's number vocabulary fits the resized logits
    number_vocab = NumberVocab.from_tokenizer(after, vocab_size=model.config.vocab_size)
    assert seven in number_vocab.token_ids


def test_digit_without_other_spelling_gets_the_mean(tokenizers_before_after):
    before, after, _root = tokenizers_before_after
    model = _tiny_llama(len(before), tied=False)
    old_input = model.get_input_embeddings().weight.detach().clone()
    # without a '▁7' to copy from, the digit row is the mean like any other new row
    vocab = after.get_vocab()
    hidden = {token: token_id for token, token_id in vocab.items() if token != "▁7"}

    class WithoutSpacedSeven:
        def __len__(self):
            return len(after)

        def get_vocab(self):
            return hidden

        def convert_ids_to_tokens(self, token_id):
            return after.convert_ids_to_tokens(token_id)

    report = resize_model_embeddings(model, WithoutSpacedSeven(), pad_to_multiple_of=1)
    seven = vocab["7"]
    assert report.copied_from == {} and report.mean_token_rows == 1 and report.new_rows == len(after)
    torch.testing.assert_close(model.get_input_embeddings().weight[seven], old_input.mean(dim=0))


def test_resize_reinitialises_new_tokens_inside_padded_rows(tokenizers_before_after):
    before, after, _root = tokenizers_before_after
    padded = len(before) + 8  # the model's vocabulary was already padded: the new "7" lands in a padding row
    model = _tiny_llama(padded, tied=False)
    old_input = model.get_input_embeddings().weight.detach().clone()
    seven, spaced_seven = after.convert_tokens_to_ids("7"), after.convert_tokens_to_ids("▁7")
    assert seven < padded
    untouched = resize_model_embeddings(model, after, pad_to_multiple_of=padded)
    assert not untouched.changed and torch.equal(model.get_input_embeddings().weight, old_input)
    report = resize_model_embeddings(model, after, pad_to_multiple_of=padded, new_token_ids=[seven])
    assert report.changed and report.new_rows == padded and report.copied_from == {"7": "▁7"}
    weight = model.get_input_embeddings().weight
    assert torch.equal(weight[seven], old_input[spaced_seven])
    mask = torch.ones(padded, dtype=torch.bool)
    mask[seven] = False
    assert torch.equal(weight[mask], old_input[mask])


def test_mean_leaves_out_spare_rows_of_a_padded_model(tokenizers_before_after):
    before, after, _root = tokenizers_before_after
    model = _tiny_llama(len(before) + 2, tied=True)
    with torch.no_grad():
        model.get_input_embeddings().weight[len(before):] = 100.0  # spare rows that never saw a token
    old_input = model.get_input_embeddings().weight.detach().clone()
    seven = after.convert_tokens_to_ids("7")
    report = resize_model_embeddings(model, after, pad_to_multiple_of=16, new_token_ids=[seven])
    weight = model.get_input_embeddings().weight
    assert report.new_rows == -(-(len(before) + 2) // 16) * 16
    assert report.padding_rows == report.new_rows - len(before) - 2
    expected = old_input[:len(before)].mean(dim=0).expand(report.padding_rows, -1)
    torch.testing.assert_close(weight[len(before) + 2:], expected)
    assert torch.equal(weight[len(before) + 1], old_input[len(before) + 1])  # an existing spare row is left alone


def test_resize_bad_arguments(tokenizers_before_after):
    before, after, _root = tokenizers_before_after
    model = _tiny_llama(len(before), tied=True)
    for bad in (0, -64, 2.5, True):
        with pytest.raises(ValueError, match="pad_to_multiple_of=.* must be a positive integer"):
            resize_model_embeddings(model, after, pad_to_multiple_of=bad)
    with pytest.raises(ValueError, match="init='xavier' is not supported"):
        resize_model_embeddings(model, after, pad_to_multiple_of=8, init="xavier")
    with pytest.raises(ValueError, match=r"new_token_ids \[99999\] are not ids"):
        resize_model_embeddings(model, after, pad_to_multiple_of=8, new_token_ids=[99999])
    assert model.config.vocab_size == len(before)  # refused before anything changed
    model.get_input_embeddings().weight.ds_id = 0  # what deepspeed.zero.Init marks partitioned parameters with
    with pytest.raises(RuntimeError, match="already partitioned by DeepSpeed ZeRO-3: resize the full model before"):
        resize_model_embeddings(model, after, pad_to_multiple_of=8)


def test_resize_model_command(tokenizers_before_after, tmp_path):
    before, after, root = tokenizers_before_after
    model = _tiny_llama(len(before), tied=False)
    model.save_pretrained(str(tmp_path / "model"))
    ids = after.encode(DIGIT_FREE_TEXT, add_special_tokens=False)
    with torch.no_grad():
        logits_before = model(torch.tensor([ids])).logits
    tool = runpy.run_path(str(REPO / "tools" / "tokenizer.py"))
    out = tmp_path / "resized"
    assert tool["main"](["resize-model", str(tmp_path / "model"), str(root / "split"), str(out),
                         "--pad-to-multiple-of", "8"]) == 0
    resized = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert resized.config.vocab_size == -(-len(after) // 8) * 8
    with torch.no_grad():
        logits_after = resized(torch.tensor([ids])).logits
    torch.testing.assert_close(logits_after[..., :len(before)], logits_before, rtol=0, atol=0)
    number_vocab = NumberVocab.load(out)
    assert number_vocab.vocab_size == resized.config.vocab_size
    assert load_tokenizer(out).get_vocab() == after.get_vocab()
    assert json.loads((out / "resize_report.json").read_text())["copied_from"] == {"7": "▁7"}
    # an existing output folder is refused without --force
    assert tool["main"](["resize-model", str(tmp_path / "model"), str(root / "split"), str(out)]) == 2


def test_resize_model_refuses_its_arguments_before_loading_the_model(tokenizers_before_after, tmp_path, monkeypatch,
                                                                      capsys):
    """`resize-model --pad-to-multiple-of 0` loaded the whole model (minutes for an 8B one) before refusing."""
    import transformers

    _before, _after, root = tokenizers_before_after
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail("the model was loaded before the arguments")))
    tool = runpy.run_path(str(REPO / "tools" / "tokenizer.py"))
    for bad in ("0", "-64"):
        assert tool["main"](["resize-model", str(tmp_path / "no_model"), str(root / "split"), str(tmp_path / "out"),
                             "--pad-to-multiple-of", bad]) == 2
        assert f"error: pad_to_multiple_of={bad} must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _error_line(stderr: str) -> str:
    """The one `error:` line of a refused command (transformers' progress bars aside), no traceback."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


def test_resize_model_refuses_a_tokenizer_far_smaller_than_the_model(shared_data, tmp_path, capsys):
    """Issue 40 item 3: a 50,257-row model with Llama-2's 32,000-token tokenizer grew to 50,304 rows ("0 new
    tokens, 47 padding rows") without a word that the two are no pair."""
    _tiny_llama(50257, tied=True).save_pretrained(str(tmp_path / "model"))
    tool = runpy.run_path(str(REPO / "tools" / "tokenizer.py"))
    llama2 = shared_data / "tokenizers" / "llama2" / "tokenizer.model"
    assert tool["main"](["resize-model", str(tmp_path / "model"), str(llama2), str(tmp_path / "out")]) == 2
    err = _error_line(capsys.readouterr().err)
    assert "has 32000 tokens but the model" in err and "50257 embedding rows" in err, err
    assert "18257 rows no token uses" in err and not (tmp_path / "out").exists()


def test_resize_model_on_a_truncated_safetensors_file(tokenizers_before_after, tmp_path, capsys):
    """Issue 40 item 9: a truncated model.safetensors gave a raw SafetensorError traceback."""
    before, _after, root = tokenizers_before_after
    _tiny_llama(len(before), tied=False).save_pretrained(str(tmp_path / "model"))
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    tool = runpy.run_path(str(REPO / "tools" / "tokenizer.py"))
    assert tool["main"](["resize-model", str(tmp_path / "model"), str(root / "split"), str(tmp_path / "out")]) == 2
    err = _error_line(capsys.readouterr().err)
    assert "its safetensors weights are damaged" in err and "download or save" in err, err
