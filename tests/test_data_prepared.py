"""A corpus tokenized and packed once (tools/prepare_data.py, `format: prepared`) and a user's own token ids
(`format: tokenized`): the same samples as the raw path, no tokenization at start-up, exact resume, and
a corpus made otherwise refused with every differing key named."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from ntl_pretrain.config import DataConfig, DataSourceConfig
from ntl_pretrain.data import DataError, PretrainingData
from ntl_pretrain.tokenizer.run import train_digit_bpe

SEQ = 16
ROOT = Path(__file__).resolve().parents[1]


def _texts(n: int) -> list[str]:
    return [f"document {i} counts {i * 13 % 97} apples and {i * 7 % 31} pears" for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_digit_bpe(_texts(200), vocab_size=300, out_dir=str(out))
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


class _NoTokenizing:
    """A tokenizer that fails when asked to tokenize (start-up from a prepared corpus must not)."""

    def __init__(self, real) -> None:
        self.real, self.eos_token_id = real, real.eos_token_id
        self.backend_tokenizer = real.backend_tokenizer

    def __call__(self, *args, **kwargs):
        raise AssertionError("tokenized at start-up")


def _prepare(tokenizer_dir: Path, corpus: Path, out: Path, num_proc: int = 1) -> list[str]:
    sys.path.insert(0, str(ROOT / "tools"))
    import prepare_data

    overrides = ["model.architecture.model_type=llama", f"tokenizer.name_or_path={tokenizer_dir}",
                 f"data.sources=[{{path: {corpus}}}]", f"data.seq_len={SEQ}", "data.validation_documents=6",
                 "data.seed=7", f"data.cache_dir={out.parent / 'cache'}"]
    assert prepare_data.main(["--out", str(out), "--num-proc", str(num_proc), *overrides]) == 0
    return sorted(str(p) for p in out.iterdir())


def _cfg(path: Path | str, tmp_path: Path, **kwargs) -> DataConfig:
    source = kwargs.pop("source", {})
    settings = dict(seq_len=SEQ, micro_batch_size=2, validation_documents=6, seed=7, cache_dir=str(tmp_path / "cache"))
    settings.update(kwargs)
    return DataConfig(sources=[DataSourceConfig(path=str(path), **source)], **settings)


def _steps(data: PretrainingData, n: int) -> list[list[list[int]]]:
    return [mb.labels.tolist() + mb.input_ids.tolist() for _ in range(n) for mb in data.next_step(2)]


def test_prepared_corpus_trains_the_raw_samples_without_tokenizing(tokenizer_dir, tokenizer, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(150)))
    folders = _prepare(tokenizer_dir, corpus, tmp_path / "prepared", num_proc=2)  # tokenized in parallel
    assert [Path(f).name for f in folders] == ["source-0"]
    manifest = json.loads((Path(folders[0]) / "manifest.json").read_text())
    assert manifest["source"]["files"] == [{"path": str(corpus), "bytes": corpus.stat().st_size}]
    from ntl_pretrain.data import resolve_files  # what the start-up checks and the checkpoint fingerprint list

    kind, files = resolve_files(DataSourceConfig(path=folders[0], format="prepared"), "data.sources.0")
    assert kind == "prepared" and files[-1].endswith("manifest.json") and any(f.endswith(".arrow") for f in files)
    raw = PretrainingData.build(_cfg(corpus, tmp_path), tokenizer, dp_rank=0, dp_size=1)
    prepared = PretrainingData.build(_cfg(folders[0], tmp_path, source={"format": "prepared"}),
                                     _NoTokenizing(tokenizer), dp_rank=0, dp_size=1)
    assert _steps(prepared, 12) == _steps(raw, 12)  # crosses an epoch of the 150 documents
    assert [s[0].tolist() for s in prepared.validation] == [s[0].tolist() for s in raw.validation]


def test_prepared_corpus_resumes_bitwise(tokenizer_dir, tokenizer, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(120)))
    folder = _prepare(tokenizer_dir, corpus, tmp_path / "prepared")[0]
    cfg = _cfg(folder, tmp_path, source={"format": "prepared"})
    straight = _steps(PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1), 20)
    first = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    got = _steps(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    resumed.load_state_dict(state)
    assert got + _steps(resumed, 13) == straight


def test_prepared_corpus_made_otherwise_is_refused_naming_every_key(tokenizer_dir, tokenizer, tmp_path, shared_data):
    from transformers import PreTrainedTokenizerFast

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(60)))
    folder = _prepare(tokenizer_dir, corpus, tmp_path / "prepared")[0]
    other = PreTrainedTokenizerFast(tokenizer_file=str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"),
                                    eos_token="<|endoftext|>")
    with pytest.raises(DataError, match=r"data.sources.0.path='.*source-0' was prepared with other settings than this "
                                        r"run's: tokenizer \(prepared '[0-9a-f]{64}', this run '[0-9a-f]{64}'\); "
                                        r"eos_token_id \(prepared 0, this run 50256\); "
                                        r"seq_len \(prepared 16, this run 32\); prepare it again"):
        PretrainingData.build(_cfg(folder, tmp_path, seq_len=32, source={"format": "prepared"}), other,
                              dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match=r"has no manifest.json: not a corpus written by tools/prepare_data.py"):
        PretrainingData.build(_cfg(tmp_path, tmp_path, source={"format": "prepared"}), tokenizer, dp_rank=0, dp_size=1)


def test_users_own_token_ids_with_a_loss_mask(tokenizer, tmp_path, caplog):
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        ids = rng.integers(5, 250, size=int(rng.integers(3, 12))).tolist()
        rows.append({"input_ids": ids, "loss_mask": [int(i % 3 != 0) for i in range(len(ids))]})
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with_gap = tmp_path / "gap.jsonl"  # a row without token ids: named, left out (in-memory source)
    with_gap.write_text(path.read_text() + '{"other": 1}\n' + path.read_text())
    with caplog.at_level(logging.WARNING):
        gap = PretrainingData.build(_cfg(with_gap, tmp_path, validation_documents=0, source={"format": "tokenized"}),
                                    _NoTokenizing(tokenizer), dp_rank=0, dp_size=1)
    assert re.search(r"skipped 1 of 81 rows that are not usable text, e\.g\. '.*gap.jsonl' line 41: column "
                     r"'input_ids' holds no token ids", caplog.text)
    tokens = sum(len(r["input_ids"]) + 1 for r in rows)
    assert gap.sources[0].size == (2 * tokens - 1) // SEQ  # every other row packed (one batch of 80 documents)
    cfg = _cfg(path, tmp_path, validation_documents=0, source={"format": "tokenized", "streaming": True})
    data = PretrainingData.build(cfg, _NoTokenizing(tokenizer), dp_rank=0, dp_size=1)
    eos = tokenizer.eos_token_id
    flat = [t for r in rows for t in r["input_ids"] + [eos]]
    mask = [bool(m) for r in rows for m in r["loss_mask"] + [1]]
    for j in range((len(flat) - 1) // SEQ):
        tokens, targets = data.sources[0].get(j)
        assert tokens.tolist() == flat[j * SEQ: (j + 1) * SEQ + 1]
        assert targets.tolist() == mask[j * SEQ: (j + 1) * SEQ + 1]
    with pytest.raises(DataError, match=r"has no column 'input_ids' \(columns: \['text'\]\), which format: tokenized"):
        bad = tmp_path / "text.jsonl"
        bad.write_text('{"text": "a"}\n' * 5)
        PretrainingData.build(_cfg(bad, tmp_path, validation_documents=0, source={"format": "tokenized"}), tokenizer,
                              dp_rank=0, dp_size=1)


def test_a_prepared_corpus_without_validation_samples_loads_and_a_damaged_one_is_named(tokenizer_dir, tokenizer,
                                                                                         tmp_path):
    """Issue 40, go-beyond round: a corpus prepared with data.validation_documents=0 (or too few documents to fill
    one sample) could not be loaded at all (`datasets` saves an empty split without data files, and its
    load_from_disk raised a raw `IndexError: list index out of range`); a truncated train/ file gave pyarrow's
    OSError, a train/ replaced by the (empty) validation/ a ZeroDivisionError, a manifest of another version was read."""
    import os
    import shutil

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(60)))
    sys.path.insert(0, str(ROOT / "tools"))
    import prepare_data

    out = tmp_path / "prepared"
    assert prepare_data.main(["--out", str(out), "model.architecture.model_type=llama",
                              f"tokenizer.name_or_path={tokenizer_dir}", f"data.sources=[{{path: {corpus}}}]",
                              f"data.seq_len={SEQ}", "data.validation_documents=0", "train.val_every_n_steps=-1", "data.seed=7",
                              f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    folder = out / "source-0"
    cfg = _cfg(folder, tmp_path, validation_documents=0, source={"format": "prepared"})
    prepared = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    raw = PretrainingData.build(_cfg(corpus, tmp_path, validation_documents=0), tokenizer, dp_rank=0, dp_size=1)
    assert len(prepared.validation) == 0 and _steps(prepared, 3) == _steps(raw, 3)

    def damaged(name: str, edit) -> Path:
        copy = tmp_path / name
        shutil.copytree(folder, copy)
        edit(copy)
        return copy

    manifest = json.loads((folder / "manifest.json").read_text())
    arrow = next((folder / "train").glob("*.arrow")).name
    cases = {
        "truncated": (lambda c: os.truncate(c / "train" / arrow, (c / "train" / arrow).stat().st_size // 2),
                      r"cannot read its train/ \(OSError: .*\); prepare the corpus again"),
        "swapped": (lambda c: (shutil.rmtree(c / "train"), shutil.copytree(c / "validation", c / "train")),
                    rf"its train/ holds 0 samples, its manifest.json says {manifest['samples']['train']} "),
        "version": (lambda c: (c / "manifest.json").write_text(json.dumps({**manifest, "version": 99})),
                    "its manifest.json is of version 99, this ntl_pretrain reads version 1"),
    }
    for name, (edit, message) in cases.items():
        copy = damaged(name, edit)
        with pytest.raises(DataError, match=message):
            PretrainingData.build(_cfg(copy, tmp_path, validation_documents=0, source={"format": "prepared"}),
                                  tokenizer, dp_rank=0, dp_size=1)
