"""What a source's rows become: prompt templates of completion-only sources (a string template or the
tokenizer's chat template), and rows or folders that are not usable text, named instead of crashing."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from ntl_pretrain.config import DataConfig, DataSourceConfig
from ntl_pretrain.data import DataError, PretrainingData

SEQ = 32


def _gpt2(shared_data: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"),
                                   eos_token="<|endoftext|>")


def _gsm8k_rows(shared_data: Path, n: int) -> list[dict]:
    with open(shared_data / "gsm8k" / "train.jsonl") as handle:
        return [json.loads(line) for line in itertools.islice(handle, n)]


def _streamed(path: Path, tmp_path: Path, **source) -> DataConfig:
    """One streamed source (read in file order: the reference is the rows as written), no held-out rows."""
    return DataConfig(sources=[DataSourceConfig(path=str(path), streaming=True, **source)], seq_len=SEQ,
                      micro_batch_size=1, validation_documents=0, cache_dir=str(tmp_path / "cache"))


def _first_pass(data: PretrainingData, count: int) -> tuple[list[int], list[bool]]:
    """The first `count` samples of the only source as one token stream and its targets mask."""
    tokens, targets = [], []
    for j in range(count):
        sample, mask = data.sources[0].get(j)
        tokens += sample[:-1].tolist()
        targets += mask[:-1].tolist()
    return tokens, targets


def _reference(tokenizer, pairs: list[tuple[str, str]], length: int) -> tuple[list[int], list[bool]]:
    tokens, targets = [], []
    for prompt, completion in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        tokens += p + c
        targets += [False] * len(p) + [True] * len(c)
    return tokens[:length], targets[:length]


def test_gsm8k_prompt_template_trains_what_the_evaluation_prompts(shared_data, tmp_path):
    tokenizer = _gpt2(shared_data)
    rows = _gsm8k_rows(shared_data, 30)
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = _streamed(path, tmp_path, prompt_field="question", completion_field="answer",
                    prompt_template="Question: {question}\nAnswer: ")
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    tokens, targets = _first_pass(data, 40)
    # the evaluation's query "Question: {q}\nAnswer:" (eval/gsm8k.py); the answer follows with its space
    expected = _reference(tokenizer, [(f"Question: {r['question']}\nAnswer:", " " + r["answer"]) for r in rows],
                          len(tokens))
    assert (tokens, targets) == expected
    text = tokenizer.decode(tokens)
    assert "April and May?\nAnswer: Natalia sold" in text and "May?Natalia" not in text


def test_completion_only_source_without_a_template_is_refused():
    from ntl_pretrain.config import ConfigError, load_config

    base = ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok", "data.sources=[{path: qa.jsonl}]",
            "data.sources.0.prompt_field=question", "data.sources.0.completion_field=answer"]
    with pytest.raises(ConfigError, match=r"data.sources.0.prompt_template is not set: say what goes between the "
                                          r"prompt and the completion, e.g. prompt_template: \"Question: \{question\}"):
        load_config(None, base)
    with pytest.raises(ConfigError, match=r"prompt_template='Q: \{0\}' has the field\(s\) \['0'\]"):
        load_config(None, base + ["data.sources.0.prompt_template='Q: {0}'"])
    with pytest.raises(ConfigError, match="prompt_template is set but prompt_field/completion_field are not"):
        load_config(None, base[:3] + ["data.sources.0.prompt_template='{prompt}'"])


def test_template_column_that_the_rows_lack_is_named(shared_data, tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _gsm8k_rows(shared_data, 10)))
    cfg = _streamed(path, tmp_path, prompt_field="question", completion_field="answer",
                    prompt_template="Context: {context}\nQ: {prompt}\nA:")
    with pytest.raises(DataError, match=r"data.sources.0.prompt_template='Context: \{context\}\\nQ: \{prompt\}\\nA:' uses "
                                        r"\{context\} but the dataset .* has no column 'context' \(columns: "
                                        r"\['question', 'answer'\]\); use one of them or \{prompt\}"):
        PretrainingData.build(cfg, _gpt2(shared_data), dp_rank=0, dp_size=1)


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_template_as_trl_prompt_is_the_generation_prompt(shared_data, tmp_path):
    tokenizer = _gpt2(shared_data)
    tokenizer.chat_template = CHAT
    rows = _gsm8k_rows(shared_data, 20)
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = _streamed(path, tmp_path, prompt_field="question", completion_field="answer", prompt_template="chat")
    tokens, targets = _first_pass(PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1), 30)
    pairs = []
    for row in rows:  # the reference: transformers' own rendering of the turn and of the whole conversation
        turn = [{"role": "user", "content": row["question"]}]
        head = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(turn + [{"role": "assistant", "content": row["answer"]}], tokenize=False)
        pairs.append((head, whole[len(head):]))
    assert (tokens, targets) == _reference(tokenizer, pairs, len(tokens))
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="prompt_template=chat needs a tokenizer with a chat template"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
