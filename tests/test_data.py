"""The data pipeline: packing, label alignment, mixing, DP sharding, determinism, resume, errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from ntl_pretrain.config import DataConfig, DataSourceConfig
from ntl_pretrain.data import DataError, Mixture, PretrainingData
from ntl_pretrain.tokenizer.run import train_digit_bpe

pytestmark = pytest.mark.fast
SEQ = 16


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {i}: {rng.integers(0, 10**6)} plus {rng.integers(0, 999)} is a number" for i in range(n)]


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_digit_bpe(_documents(300, seed=1), vocab_size=320, out_dir=str(out))
    return AutoTokenizer.from_pretrained(out)


def _cfg(sources: list[DataSourceConfig], tmp_path: Path, **kwargs) -> DataConfig:
    defaults = dict(seq_len=SEQ, micro_batch_size=2, validation_documents=5, seed=7, cache_dir=str(tmp_path / "cache"))
    defaults.update(kwargs)
    return DataConfig(sources=sources, **defaults)


def test_digit_bpe_splits_every_digit(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("In 2024, 12345 and x7")["input_ids"])
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("2024") + list("12345") + ["7"]
    assert tokenizer.decode(tokenizer("In 2024, 12345 and x7")["input_ids"]) == "In 2024, 12345 and x7"


def test_packing_matches_a_plain_reference(tokenizer, tmp_path):
    import datasets

    texts = _documents(60)
    path = _write_jsonl(tmp_path / "c.jsonl", texts)
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=0)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    source = data.sources[0]
    # reference: the documents in the split's (seeded) order, each followed by EOS, as one token stream;
    # sample i is the window [i*SEQ, (i+1)*SEQ] (consecutive samples share one token), the tail is dropped
    order = datasets.Dataset.from_dict({"text": texts}).shuffle(seed=cfg.seed)["text"]
    stream = [t for text in order for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    expected = [stream[i * SEQ: (i + 1) * SEQ + 1] for i in range((len(stream) - 1) // SEQ)]
    packed = [np.asarray(source.samples[i]["tokens"]).tolist() for i in range(source.size)]
    assert packed == expected
    assert sum(s.count(tokenizer.eos_token_id) for s in expected) >= len(texts) - 1


def test_labels_are_inputs_shifted_by_one_and_skip_document_starts(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(80))
    eos = tokenizer.eos_token_id
    for mask in (True, False):
        cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, mask_document_start=mask)
        data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
        batches = [data.next_step(1)[0] for _ in range(6)]
        assert batches[0].input_ids.shape == batches[0].labels.shape == (2, SEQ)
        for step, batch in enumerate(batches):
            for row in range(2):
                window = data.sample(step * 2 + row).tolist()
                want = [-100 if mask and prev == eos else nxt for prev, nxt in zip(window[:-1], window[1:])]
                assert batch.input_ids[row].tolist() == window[:-1] and batch.labels[row].tolist() == want
        assert sum(int((b.input_ids == eos).sum()) for b in batches) > 0  # the check above did see boundaries


def test_dp_ranks_split_the_global_batch_and_tp_ranks_agree(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(120))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path)
    single = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    cfg_mb1 = _cfg([DataSourceConfig(path=str(path))], tmp_path, micro_batch_size=1)
    ranks = [PretrainingData.build(cfg_mb1, tokenizer, dp_rank=r, dp_size=2) for r in range(2)]
    tp_twin = PretrainingData.build(cfg_mb1, tokenizer, dp_rank=1, dp_size=2)  # another TP rank of DP rank 1
    for _ in range(3):
        whole = single.next_step(2)  # 2 micro-batches x 2 sequences = 4 sequences
        parts = [r.next_step(2) for r in ranks]  # 2 ranks x 2 micro-batches x 1 sequence
        twin = tp_twin.next_step(2)
        merged = sorted(tuple(row) for p in parts for mb in p for row in mb.input_ids.tolist())
        assert merged == sorted(tuple(row) for mb in whole for row in mb.input_ids.tolist())
        assert [mb.input_ids.tolist() for mb in twin] == [mb.input_ids.tolist() for mb in parts[1]]
        assert parts[0][0].input_ids.tolist() != parts[1][0].input_ids.tolist()


def test_same_seed_same_stream_other_seed_other_order(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(100))
    make = lambda seed: PretrainingData.build(_cfg([DataSourceConfig(path=str(path))], tmp_path, seed=seed),
                                              tokenizer, dp_rank=0, dp_size=1)
    a, b, c = make(3), make(3), make(4)
    steps = lambda d: [mb.input_ids.tolist() for _ in range(4) for mb in d.next_step(1)]
    first = steps(a)
    assert first == steps(b) and first != steps(c)


def test_resume_continues_without_repeating_or_skipping(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(100))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path)
    straight = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    expected = [straight.next_step(1)[0].input_ids.tolist() for _ in range(40)]  # crosses an epoch boundary
    first = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    got = [first.next_step(1)[0].input_ids.tolist() for _ in range(17)]
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    resumed = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    resumed.load_state_dict(state)
    got += [resumed.next_step(1)[0].input_ids.tolist() for _ in range(23)]
    assert got == expected
    other = PretrainingData.build(_cfg([DataSourceConfig(path=str(path))], tmp_path, seed=99), tokenizer,
                                  dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="differs from data.seed=99"):
        other.load_state_dict(state)


def test_mixture_follows_the_weights_and_counts_per_source():
    mixture = Mixture([1.0, 3.0], seed=5)
    located = [mixture.locate(g) for g in range(10000)]
    share = np.mean([s for s, _ in located])
    assert abs(share - 0.75) < 0.02
    for source in (0, 1):  # each source's samples are consumed in order 0, 1, 2, ... without gaps
        indices = [j for s, j in located if s == source]
        assert indices == list(range(len(indices)))


def test_two_sources_are_both_used(tokenizer, tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [f"alpha {i} " * 4 for i in range(60)])
    b = _write_jsonl(tmp_path / "b.jsonl", [f"beta {i} " * 4 for i in range(60)])
    cfg = _cfg([DataSourceConfig(path=str(a)), DataSourceConfig(path=str(b), weight=1.0)], tmp_path)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    text = " ".join(tokenizer.decode(mb.input_ids[0]) for _ in range(30) for mb in data.next_step(1))
    assert "alpha" in text and "beta" in text


def test_text_files_parquet_and_streaming(tokenizer, tmp_path):
    import datasets

    texts = _documents(50)
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "c.parquet"))
    for source in (DataSourceConfig(path=str(tmp_path / "c.txt")),
                   DataSourceConfig(path=str(tmp_path / "c.parquet"), text_field="body"),
                   DataSourceConfig(path=str(tmp_path / "c.parquet"), text_field="body", streaming=True)):
        data = PretrainingData.build(_cfg([source], tmp_path), tokenizer, dp_rank=0, dp_size=1)
        batches = [data.next_step(1)[0] for _ in range(30)]  # streaming wraps around its end
        assert all(b.input_ids.shape == (2, SEQ) for b in batches)
        assert len(data.validation) > 0


def test_validation_batches_are_the_same_count_on_every_rank(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(100))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=20)
    counts = [len(PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=3).validation_micro_batches(50))
              for r in range(3)]
    assert len(set(counts)) == 1 and counts[0] >= 1
    tiny = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=1)
    data = PretrainingData.build(tiny, tokenizer, dp_rank=0, dp_size=8)
    with pytest.raises(DataError, match="raise data.validation_documents"):
        data.check_validation(4)


# ---------------------------------------------------------------------------------------------- bad input
def test_missing_data_file_is_named(tokenizer, tmp_path):
    cfg = _cfg([DataSourceConfig(path=str(tmp_path / "nope.jsonl"))], tmp_path)
    with pytest.raises(DataError, match=r"data.sources.0.path='.*nope.jsonl': no such file"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_dataset_without_the_text_field(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(30), field="content")
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path)
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['content'\]\); set data.sources.0.text_field"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_empty_dataset(tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    cfg = _cfg([DataSourceConfig(path=str(tmp_path / "empty.jsonl"))], tmp_path)
    with pytest.raises(DataError, match="empty.jsonl"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_too_few_tokens_for_one_sample(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", ["1", "2", "3"])
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=1, seq_len=64)
    with pytest.raises(DataError, match="fewer than data.seq_len"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_fewer_documents_than_held_out(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(4))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=10)
    with pytest.raises(DataError, match="lower data.validation_documents"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


# ---------------------------------------------------------------------------------------------- completion only
def _problems(n: int, seed: int = 0) -> list[dict]:
    """Prompt/completion rows of varied lengths; one in ten has an empty prompt (a plain document)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = int(rng.integers(0, 10 ** int(rng.integers(1, 5)))), int(rng.integers(0, 1000))
        rows.append({"prompt": "" if i % 10 == 9 else f"Q: {a}+{b}=", "completion": f" {a + b}", "id": i})
    return rows


def _gpt2(shared_data):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(shared_data / "tokenizers" / "gpt2" / "tokenizer.json"),
                                   eos_token="<|endoftext|>")


def _reference_stream(tokenizer, rows: list[dict]) -> tuple[list[int], list[bool]]:
    """Tokens and target flags of the rows in this order: prompt (no target), completion + EOS (targets)."""
    tokens: list[int] = []
    targets: list[bool] = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        tokens += prompt + completion + [tokenizer.eos_token_id]
        targets += [False] * len(prompt) + [True] * (len(completion) + 1)
    return tokens, targets


def _completion_source(path: Path) -> DataSourceConfig:
    return DataSourceConfig(path=str(path), prompt_field="prompt", completion_field="completion",
                            prompt_template="{prompt}")


@pytest.mark.parametrize("seq_len", [5, 8])
def test_completion_only_labels_are_exact_at_every_packing_boundary(shared_data, tmp_path, seq_len):
    import datasets

    tokenizer = _gpt2(shared_data)
    eos = tokenizer.eos_token_id
    rows = _problems(80)
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg([_completion_source(path)], tmp_path, seq_len=seq_len, micro_batch_size=1, validation_documents=0)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    source = data.sources[0]

    # reference: the rows in the split's seeded order as one stream, cut into windows of seq_len + 1
    order = datasets.Dataset.from_list(rows).shuffle(seed=cfg.seed).to_list()
    tokens, targets = _reference_stream(tokenizer, order)
    count = (len(tokens) - 1) // seq_len
    windows = [slice(i * seq_len, (i + 1) * seq_len + 1) for i in range(count)]
    packed = [source.samples[i] for i in range(source.size)]
    assert [p["tokens"].tolist() for p in packed] == [tokens[w] for w in windows]
    assert [p["targets"].tolist() for p in packed] == [targets[w] for w in windows]
    # the cases the masking must get right do occur: a completion cut by a sample boundary, a sample that
    # ends inside a prompt, one that ends on the EOS, and a sample that holds no target at all
    ends = [(targets[w][-1], tokens[w][-1]) for w in windows]
    assert any(t and tok != eos for t, tok in ends) and any(not t for t, _ in ends) and any(tok == eos for _, tok in ends)

    # one epoch of micro-batches: label t is token t+1 when that token is a target (completion or EOS) and
    # the input is not an EOS (data.mask_document_start), else ignored; every target in the stream except
    # the untrainable ones is trained exactly once
    seen_targets = 0
    for step in range(source.size):
        (batch,) = data.next_step(1)
        window, flags = data.sample_with_targets(step)
        want = [nxt if flag and prev != eos else -100
                for prev, nxt, flag in zip(window[:-1].tolist(), window[1:].tolist(), flags[1:].tolist())]
        assert batch.input_ids[0].tolist() == window[:-1].tolist() and batch.labels[0].tolist() == want
        seen_targets += int((batch.labels != -100).sum())
    covered = range(1, count * seq_len + 1)  # stream positions some sample has as a label
    assert seen_targets == sum(targets[p] and tokens[p - 1] != eos for p in covered)
    # what the loss is normalised over: the completion tokens (and EOS), never a prompt token
    completion_ids = {t for row in rows for t in tokenizer(row["completion"], add_special_tokens=False)["input_ids"]}
    data.position = 0
    labelled = [t for _ in range(source.size) for t in data.next_step(1)[0].labels[0].tolist() if t != -100]
    assert set(labelled) <= completion_ids | {eos} and tokenizer.encode("Q")[0] not in labelled


def test_completion_only_counts_only_completion_tokens_in_the_loss_normaliser(tokenizer, tmp_path):
    from ntl_pretrain.loss.ntl import NTLSettings
    from ntl_pretrain.loss.normalize import count_step
    from ntl_pretrain.numbers import NumberVocab

    rows = [{"prompt": f"{i}+{i * 7}=", "completion": str(i * 8)} for i in range(200)]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg([_completion_source(path)], tmp_path, validation_documents=0, mask_document_start=False)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    batches = data.next_step(3)
    counts = count_step([b.labels for b in batches], NumberVocab.from_tokenizer(tokenizer), NTLSettings())
    targets = sum(int(data.sample_with_targets(g)[1][1:].sum()) for g in range(3 * cfg.micro_batch_size))
    assert float(counts.tokens) == targets < sum(b.labels.numel() for b in batches)


def test_completion_only_dp_ranks_split_and_tp_ranks_agree(tokenizer, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _problems(150)))
    single = PretrainingData.build(_cfg([_completion_source(path)], tmp_path), tokenizer, dp_rank=0, dp_size=1)
    cfg_mb1 = _cfg([_completion_source(path)], tmp_path, micro_batch_size=1)
    ranks = [PretrainingData.build(cfg_mb1, tokenizer, dp_rank=r, dp_size=2) for r in range(2)]
    tp_twin = PretrainingData.build(cfg_mb1, tokenizer, dp_rank=1, dp_size=2)
    for _ in range(4):
        whole = single.next_step(2)
        parts = [r.next_step(2) for r in ranks]
        twin = tp_twin.next_step(2)
        rows = lambda batches: sorted((tuple(i), tuple(lab)) for mb in batches  # noqa: E731
                                      for i, lab in zip(mb.input_ids.tolist(), mb.labels.tolist()))
        assert rows([mb for p in parts for mb in p]) == rows(whole)
        assert [mb.labels.tolist() for mb in twin] == [mb.labels.tolist() for mb in parts[1]]
        assert any((mb.labels == -100).any() for mb in whole)
    # the validation split is masked the same way
    assert all((mb.labels == -100).any() for mb in single.validation_micro_batches(2))


def test_completion_only_mixes_with_a_plain_source(tokenizer, tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in _problems(100)))
    plain = _write_jsonl(tmp_path / "plain.jsonl", _documents(100))
    cfg = _cfg([_completion_source(qa), DataSourceConfig(path=str(plain))], tmp_path, mask_document_start=False)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    kinds = set()
    for g in range(40):
        tokens, targets = data.sample_with_targets(g)
        kinds.add(targets is None)
    assert kinds == {True, False}
    for _ in range(20):  # a plain sample is trained on every token, a completion sample on its targets only
        (batch,) = data.next_step(1)
        g = data.position - cfg.micro_batch_size
        for row in range(cfg.micro_batch_size):
            _, targets = data.sample_with_targets(g + row)
            ignored = (batch.labels[row] == -100).tolist()
            assert ignored == ([False] * SEQ if targets is None else (~targets[1:]).tolist())


@pytest.mark.parametrize("setting, column", [("prompt_field", "question"), ("completion_field", "answer")])
def test_completion_only_bad_field_names_the_key_and_the_columns(tokenizer, tmp_path, setting, column):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _problems(30)))
    source = _completion_source(path)
    setattr(source, setting, column)
    with pytest.raises(DataError, match=rf"no column '{column}' \(columns: \['prompt', 'completion', 'id'\]\); "
                                        rf"set data.sources.0.{setting} to one of them"):
        PretrainingData.build(_cfg([source], tmp_path), tokenizer, dp_rank=0, dp_size=1)


def test_completion_only_numbers_stored_as_numbers_are_refused(tokenizer, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": i + 1}) + "\n" for i in range(30)))
    with pytest.raises(DataError, match=r"data.sources.0.completion_field='completion': the column holds int64, "
                                        r"not text"):
        PretrainingData.build(_cfg([_completion_source(path)], tmp_path), tokenizer, dp_rank=0, dp_size=1)


def test_completion_only_needs_both_fields():
    from ntl_pretrain.config import ConfigError, load_config

    base = ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok", "data.sources=[{path: qa.jsonl}]"]
    with pytest.raises(ConfigError, match="data.sources.0.prompt_field is set but data.sources.0.completion_field "
                                          "is not"):
        load_config(None, base + ["data.sources.0.prompt_field=prompt"])
    with pytest.raises(ConfigError, match="both 'x'"):
        load_config(None, base + ["data.sources.0.prompt_field=x", "data.sources.0.completion_field=x"])
    cfg = load_config(None, base + ["data.sources.0.prompt_field=p", "data.sources.0.completion_field=c",
                                    "data.sources.0.prompt_template='{prompt}'"])
    assert (cfg.data.sources[0].prompt_field, cfg.data.sources[0].completion_field) == ("p", "c")


# ---------------------------------------------------------------------------------------------- generated corpus
def _corpus_config(path: Path, *overrides: str):
    from ntl_pretrain.config import load_config

    return load_config(None, ["model.architecture.model_type=llama", "tokenizer.name_or_path=unused",
                              "tokenizer.train_vocab_size=0", f"data.sources.0.path={path}",
                              "data.sources.0.generate_arithmetic=300",
                              "data.sources.0.generate_options={train_digits: [1, 2], ops: ['+', '*']}", "eval.arithmetic_n=0",
                              *overrides])


def test_generated_corpus_depends_only_on_its_settings_not_on_the_run_seed(tmp_path):
    from ntl_pretrain.trainer.trainer import _prepare_assets

    for seed in (1, 2):  # two runs of one config with other data seeds, each the first to start
        _prepare_assets(_corpus_config(tmp_path / f"run{seed}" / "arith.jsonl", f"data.seed={seed}"))
    first, second = ((tmp_path / f"run{seed}" / "arith.jsonl").read_bytes() for seed in (1, 2))
    assert first == second and len(first.splitlines()) == 300
    # the corpus's own seed does change it
    _prepare_assets(_corpus_config(tmp_path / "other" / "arith.jsonl", "data.sources.0.generate_options.seed=7"))
    assert (tmp_path / "other" / "arith.jsonl").read_bytes() != first
    # a second run with the same settings reuses the file as it is
    before = os.stat(tmp_path / "run1" / "arith.jsonl").st_mtime_ns
    _prepare_assets(_corpus_config(tmp_path / "run1" / "arith.jsonl", "data.seed=3"))
    assert os.stat(tmp_path / "run1" / "arith.jsonl").st_mtime_ns == before


@pytest.mark.parametrize("override, differ", [
    ("data.sources.0.generate_arithmetic=400", "n 300 (this config: 400)"),
    ("data.sources.0.generate_options.seed=9", "seed 1234 (this config: 9)"),
    ("data.sources.0.generate_options.ops=['+']", "ops ['+', '*'] (this config: ['+'])"),
    ("data.sources.0.generate_options.text_share=0.0", "text_share 0.2 (this config: 0.0)"),
])
def test_a_corpus_generated_with_other_settings_is_refused_never_reused(tmp_path, override, differ):
    from ntl_pretrain.trainer.trainer import _prepare_assets

    path = tmp_path / "arith.jsonl"
    _prepare_assets(_corpus_config(path))
    content = path.read_bytes()
    with pytest.raises(DataError, match=rf"data.sources.0: {re.escape(str(path))} was generated with other settings: "
                                        rf"{re.escape(differ)}; delete {re.escape(str(path))}"):
        _prepare_assets(_corpus_config(path, override))
    assert path.read_bytes() == content


def test_a_corpus_without_settings_or_edited_since_is_refused(tmp_path):
    from ntl_pretrain.trainer.trainer import _prepare_assets

    path = tmp_path / "arith.jsonl"
    _write_jsonl(path, ["1+1=2"] * 300)  # by hand, or by a version that wrote no settings
    with pytest.raises(DataError, match=r"has no arith.jsonl.settings beside it, so its generation settings are unknown"):
        _prepare_assets(_corpus_config(path))
    path.unlink()
    _prepare_assets(_corpus_config(path))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "1+1=2", "prompt": "1+1=", "completion": "2"}) + "\n")
    with pytest.raises(DataError, match="its SHA-256 does not match arith.jsonl.settings"):
        _prepare_assets(_corpus_config(path))


def test_generated_corpus_trains_completion_only(tokenizer, tmp_path):
    from ntl_pretrain.trainer.trainer import _prepare_assets

    path = tmp_path / "arith.jsonl"
    _prepare_assets(_corpus_config(path, "data.sources.0.generate_options.text_share=0.0"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["text"] == r["prompt"] + r["completion"] and r["prompt"].endswith("=") for r in rows)
    cfg = _cfg([_completion_source(path)], tmp_path, mask_document_start=False)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    (batch,) = data.next_step(1)
    text = tokenizer.decode([t for t in batch.labels.reshape(-1).tolist() if t != -100])
    assert set(text) <= set("0123456789-" + tokenizer.eos_token) and "=" not in text and "+" not in text


def test_long_tokenization_is_chunked_with_progress_lines_and_the_same_samples(tokenizer, tmp_path, caplog,
                                                                                monkeypatch):
    import logging

    from ntl_pretrain.data import sources

    path = _write_jsonl(tmp_path / "a.jsonl", _documents(1500))
    whole = PretrainingData.build(_cfg([DataSourceConfig(path=str(path))], tmp_path), tokenizer, dp_rank=0, dp_size=1)
    monkeypatch.setattr(sources, "PACK_CHUNK", 1000)
    monkeypatch.setattr(sources, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="ntl_pretrain.data.sources"):
        chunked = PretrainingData.build(_cfg([DataSourceConfig(path=str(path))], tmp_path / "other"), tokenizer,
                                        dp_rank=0, dp_size=1)
    progress = [r.getMessage() for r in caplog.records if " of 1495 documents" in r.getMessage()]
    assert [line.split(",")[0] for line in progress] == ["packing data.sources.0: 1000 of 1495 documents"]
    assert whole.sources[0].samples.with_format(None)["tokens"] == chunked.sources[0].samples.with_format(None)["tokens"]
