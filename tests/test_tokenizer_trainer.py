"""The trainer's tokenizer loading: what tools/tokenizer.py accepts, and one clear line for what it cannot use."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import sentencepiece
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers.models import tiny_llama
from ntl_pretrain.config import load_config
from ntl_pretrain.models.build import load_run_tokenizer as load_tokenizer

from test_tokenizer_families import all_digit_texts, build_spm
from test_train_errors import _cli

pytestmark = pytest.mark.timeout(300)
LLAMA2_MODEL = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "llama2" / "tokenizer.model"


def _cfg(tokenizer: str | Path, *overrides: str):
    return load_config(None, ["model.architecture.model_type=llama", f"tokenizer.name_or_path={tokenizer}",
                              "data.sources.0.path=c.jsonl", *overrides])


def _three_token_tokenizer(folder: Path) -> Path:
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)
    return folder


def _tiny_llama(folder: Path, vocab_size: int = 512) -> Path:
    tiny_llama(vocab_size, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=2048).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("which", ["built_here", "llama2"])
def test_sentencepiece_model_file_is_accepted(which, tmp_path):
    if which == "llama2":
        if not LLAMA2_MODEL.is_file():
            pytest.fail("shared Llama-2 tokenizer absent: the tests need ../shared/data beside the clone")
        model_file = LLAMA2_MODEL
    else:
        model_file = build_spm(tmp_path / "spm", split_digits=True) / "tokenizer.model"
    tokenizer = load_tokenizer(_cfg(model_file).tokenizer, _cfg(model_file).model)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    assert tokenizer.eos_token_id == processor.eos_id() and len(tokenizer) == processor.get_piece_size()
    for text in all_digit_texts()[:50]:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == processor.encode(text)


def test_missing_local_tokenizer_path_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for source, expected in [(tmp_path / "nowhere" / "tok", "does not exist"),
                             ("runs/missing_tokenizer", "does not exist"),
                             ("./missing_tokenizer", "does not exist")]:
        cfg = _cfg(source)
        with pytest.raises(ValueError) as info:
            load_tokenizer(cfg.tokenizer, cfg.model)
        message = str(info.value)
        assert expected in message and "tokenizer.name_or_path" in message and str(source) in message, message
        assert "Repo id must be" not in message and "\n" not in message
    missing_model = f"model.name_or_path={tmp_path / 'nowhere' / 'model'}"
    for tokenizer in ("null", _three_token_tokenizer(tmp_path / "tiny")):  # the model's path, or its config's
        cfg = _cfg(tokenizer, missing_model)
        with pytest.raises(ValueError, match=r"model.name_or_path='.*nowhere/model' does not exist"):
            load_tokenizer(cfg.tokenizer, cfg.model)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying the Hub
    cfg = _cfg("not_a_local_folder_or_hub_id")  # a hub-id spelling: tried on the Hub, the answer on one line
    with pytest.raises(ValueError) as info:
        load_tokenizer(cfg.tokenizer, cfg.model)
    assert "neither a local path" in str(info.value) and "\n" not in str(info.value)


def test_tokenizer_far_smaller_than_the_model_vocabulary(tmp_path):
    model = _tiny_llama(tmp_path / "model")
    cfg = _cfg(_three_token_tokenizer(tmp_path / "tiny"), f"model.name_or_path={model}")
    with pytest.raises(ValueError) as info:
        load_tokenizer(cfg.tokenizer, cfg.model)
    message = str(info.value)
    assert "has 3 tokens, far fewer than the 512 embedding rows" in message and "not this model's tokenizer" in message
    assert "split-digits" in message  # only as the way to convert the model's own tokenizer
    digit_bpe = build_spm(tmp_path / "spm", split_digits=True)  # 400 pieces for 512 rows: a padded model, accepted
    cfg = _cfg(digit_bpe, f"model.name_or_path={model}")
    assert len(load_tokenizer(cfg.tokenizer, cfg.model)) <= 512


def test_trainer_gives_one_clear_line_before_building_the_model(tmp_path):
    """The real entry point: exit 2, the message on stderr, no run folder."""
    model = _tiny_llama(tmp_path / "model")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": "hello 12"}) + "\n" for _ in range(600)))
    result = _cli(tmp_path, "parallel.tp_size=1", f"model.name_or_path={model}", "model.architecture={}",
                  f"tokenizer.name_or_path={_three_token_tokenizer(tmp_path / 'tiny')}",
                  f"data.sources.0.path={tmp_path / 'c.jsonl'}")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has 3 tokens, far fewer than the 512 embedding rows" in errors[0], result.stderr[-3000:]
    assert not (tmp_path / "run").exists()
