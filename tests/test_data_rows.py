"""What a source's rows become: prompt templates of completion-only sources (a string template or the
tokenizer's chat template), and rows or folders that are not usable text, named instead of crashing."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
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


# ---------------------------------------------------------------------------------------------- bad rows
def _bad_corpus(path: Path, limit: int) -> list[str]:
    """A corpus with one row of each unusable kind among good ones; returns the good texts in file order."""
    good = [f"row {i} says {i * 37} and more words follow here" for i in range(40)]
    bad = [{"text": None}, {"other": "no text field"}, {"text": 357}, {"text": {"nested": "object"}},
           {"text": "x" * (limit + 1)}]
    rows = [{"text": t} for t in good]
    for offset, row in enumerate(bad):
        rows.insert(2 + offset * 7, row)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return good


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_rows_are_skipped_counted_and_named(shared_data, tmp_path, caplog, streaming):
    import datasets

    tokenizer = _gpt2(shared_data)
    good = _bad_corpus(tmp_path / "c.jsonl", limit=100)
    cfg = DataConfig(sources=[DataSourceConfig(path=str(tmp_path / "c.jsonl"), streaming=streaming)], seq_len=8,
                     micro_batch_size=1, validation_documents=0, max_document_chars=100,
                     cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
        source = data.sources[0]  # in packing order (not the training permutation of an in-memory source)
        samples = [(source.get(j)[0] if streaming else source.samples[j]["tokens"])[:-1].tolist() for j in range(30)]
    # the reference: the good rows alone (in the seeded order of a shuffled in-memory source)
    order = good if streaming else datasets.Dataset.from_dict({"text": good}).shuffle(seed=cfg.seed)["text"]
    stream = [t for text in order for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [50256]]
    assert [t for s in samples for t in s] == stream[:len(samples) * 8]
    if streaming:  # named by file and line as the stream reads them (the first three, then at each doubling)
        assert re.search(r"data.sources.0: skipped a streamed row, '.*c.jsonl' line 3: column 'text' holds no text "
                         r"\(null or missing\) \(1 row\(s\) skipped so far\)", caplog.text)
        assert re.search(r"'.*c.jsonl' line 17: column 'text' holds a number, not text \(3 row", caplog.text)
        assert re.search(r"'.*c.jsonl' line 24: column 'text' holds a dict, not text \(4 row", caplog.text)
        assert "(5 row(s) skipped so far)" not in caplog.text  # not a line per row
    else:  # counted up front, the first ones named by file and line
        assert re.search(r"skipped 5 of 45 rows that are not usable text, e.g. '.*c.jsonl' line 3: column 'text' "
                         r"holds no text \(null or missing\); '.*c.jsonl' line 10: column 'text' holds no text "
                         r"\(null or missing\); '.*c.jsonl' line 17: column 'text' holds a number, not text",
                         caplog.text)


@pytest.mark.parametrize("line, why", [
    ('{"text": null}', "column 'text' holds no text (null or missing)"),
    ('{"body": "no text field"}', "column 'text' holds no text (null or missing)"),
    ('{"text": 357}', "column 'text' holds a number, not text"),
    ('{"text": {"nested": "object"}}', "column 'text' holds a dict, not text"),
    ('{"text": "%s"}' % ("x" * 101), "column 'text' holds 101 characters, over data.max_document_chars=100"),
    ('{"text": "cut off', "not valid JSON"),
    ('["a", "list"]', "a JSON list, not an object"),
    ('"a string"', "a JSON str, not an object"),
])
def test_each_bad_streamed_row_is_named_by_file_and_line(shared_data, tmp_path, caplog, line, why):
    tokenizer = _gpt2(shared_data)
    rows = [json.dumps({"text": f"row {i} says {i * 37}"}) for i in range(30)]
    rows.insert(11, line)  # line 12 of the file
    (tmp_path / "c.jsonl").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(sources=[DataSourceConfig(path=str(tmp_path / "c.jsonl"), streaming=True)], seq_len=8,
                     micro_batch_size=1, validation_documents=3, max_document_chars=100,
                     cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
        samples = [data.sources[0].get(j)[0][:-1].tolist() for j in range(8)]
    assert f"c.jsonl' line 12: {why}" in caplog.text and "(1 row(s) skipped so far)" in caplog.text
    good = [json.loads(r)["text"] for r in rows[3:] if r != line]
    stream = [t for text in good for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [50256]]
    assert [t for s in samples for t in s] == stream[:len(samples) * 8]


# ---------------------------------------------------------------------------------------------- odd folders
def test_folder_with_a_symlink_loop_is_refused_and_linked_files_read_once(tmp_path):
    from ntl_pretrain.data import resolve_files

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"text": "a"}\n')
    (folder / "sub" / "b.jsonl").write_text('{"text": "b"}\n')
    (folder / "again.jsonl").symlink_to(folder / "a.jsonl")  # one file under two names: read once
    (folder / "sub2").symlink_to(folder / "sub")  # one folder under two names: its files read once
    builder, files = resolve_files(DataSourceConfig(path=str(folder)), "data.sources.0")
    assert builder == "json" and sorted(os.path.realpath(f) for f in files) == sorted(
        [str((folder / "a.jsonl").resolve()), str((folder / "sub" / "b.jsonl").resolve())])
    (folder / "sub" / "up").symlink_to(folder)  # a loop: sub/up/sub/up/... would list a.jsonl again and again
    with pytest.raises(DataError, match=r"data.sources.0.path='.*corpus': '.*sub2?/up' links to '.*corpus', a folder "
                                        r"it is inside \(a symlink loop"):
        resolve_files(DataSourceConfig(path=str(folder)), "data.sources.0")


def test_fifo_is_named_as_such(tmp_path):
    from ntl_pretrain.data import resolve_files

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"data.sources.0.path='.*pipe.jsonl' is a FIFO \(named pipe\), not a file"):
        resolve_files(DataSourceConfig(path=str(fifo)), "data.sources.0")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "a"}\n')
    os.mkfifo(folder / "b.jsonl")
    with pytest.raises(DataError, match=r"'.*corpus/b.jsonl' is a FIFO \(named pipe\), not a file; remove it"):
        resolve_files(DataSourceConfig(path=str(folder)), "data.sources.0")


def test_a_text_files_byte_order_mark_is_not_its_first_documents_text(tmp_path):
    from ntl_pretrain.data import load_documents

    (tmp_path / "a.txt").write_bytes("\ufefffirst line\r\nsecond line\r\n".encode("utf-8"))
    documents = load_documents(DataSourceConfig(path=str(tmp_path / "a.txt")), "data.sources.0", str(tmp_path / "c"))
    assert documents["text"] == ["first line", "second line"]


def test_a_streamed_json_array_is_refused_with_the_conversion(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": f"row {i}"} for i in range(5)]))
    cfg = DataConfig(sources=[DataSourceConfig(path=str(tmp_path / "a.json"), streaming=True)], seq_len=8,
                     micro_batch_size=1, validation_documents=1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"'.*a.json' is a JSON array, not JSON lines: a stream cannot seek in it; "
                                        r"write it one object a line \(`jq -c '\.\[\]' IN > OUT.jsonl`\) or set "
                                        r"streaming: false"):
        PretrainingData.build(cfg, None, dp_rank=0, dp_size=1)
