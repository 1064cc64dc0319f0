"""Staged data mixtures (data.stages): validation, the switch exactly at a stage's first step, sources read on
across stages, resume mid-stage and at a boundary bitwise, the resume policy for edited stages, the dry run's table."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ntl_pretrain.checkpoint.fingerprint import check_data
from ntl_pretrain.checkpoint.format import CheckpointError
from ntl_pretrain.config import ConfigError, DataConfig, DataSourceConfig, DataStageConfig, load_config
from ntl_pretrain.data import PretrainingData, data_description
from ntl_pretrain.data.stream import combine_rank_states
from ntl_pretrain.tokenizer.run import train_digit_bpe

pytestmark = pytest.mark.fast
SEQ, MBS, ACCUM, DP = 16, 2, 2, 2
STAGES = [DataStageConfig(1, [1.0, 0.0]), DataStageConfig(4, {"replay": 1.0}), DataStageConfig(7, [1.0, 1.0])]


def _web(i: int) -> str:
    return f"web page {i} says {i * 37 % 1000} apples cost {i % 9}"


def _replay(f: int, d: int) -> str:
    return f"old corpus file {f} line {d} counts {f * 1000 + d}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_digit_bpe([_web(i) for i in range(100)] + [_replay(f, d) for f in range(2) for d in range(50)],
                    vocab_size=320, out_dir=str(out))
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[DataSourceConfig]:
    """web: in memory; replay: streamed from 2 files, so each of 2 data-parallel ranks reads its own share."""
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "web.jsonl").write_text("".join(json.dumps({"text": _web(i)}) + "\n" for i in range(150)))
    (folder / "replay").mkdir()
    for f in range(2):
        (folder / "replay" / f"part-{f}.jsonl").write_text(
            "".join(json.dumps({"text": _replay(f, d)}) + "\n" for d in range(120)))
    return [DataSourceConfig(path=str(folder / "web.jsonl"), label="web"),
            DataSourceConfig(path=str(folder / "replay"), streaming=True, label="replay")]


def _cfg(sources, tmp_path: Path, stages=STAGES, validation_documents: int = 5) -> DataConfig:
    return DataConfig(sources=sources, stages=list(stages), seq_len=SEQ, micro_batch_size=MBS,
                      validation_documents=validation_documents, seed=7, cache_dir=str(tmp_path / "cache"))


def _steps(ranks: list[PretrainingData], steps: int) -> list[list[tuple[int, ...]]]:
    """Per step, the global batch's samples (input ids) in global order: micro-batch m of rank r is slice m*dp+r."""
    out = []
    for _ in range(steps):
        per_rank = [data.next_step(ACCUM) for data in ranks]
        out.append([tuple(row) for m in range(ACCUM) for batches in per_rank for row in batches[m].input_ids.tolist()])
    return out


def _build(cfg: DataConfig, tokenizer) -> list[PretrainingData]:
    return [PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=DP) for r in range(DP)]


def test_each_step_is_drawn_with_its_stage_and_sources_read_on_across_stages(tokenizer, sources, tmp_path):
    ranks = _build(_cfg(sources, tmp_path), tokenizer)
    web = ranks[0].sources[0]
    web_samples = {tuple(web.get(j)[0][:-1].tolist()): j for j in range(web.size)}
    steps = _steps(ranks, 9)
    kinds = [["web" if sample in web_samples else "replay" for sample in step] for step in steps]
    # stage 0 = steps 1-3 (web only), stage 1 = steps 4-6 (replay only), stage 2 = steps 7- (both)
    assert all(set(kind) == {"web"} for kind in kinds[:3]) and all(set(kind) == {"replay"} for kind in kinds[3:6])
    assert set(kinds[6] + kinds[7] + kinds[8]) == {"web", "replay"}
    figures = [data.stage_figures() for data in ranks]  # every rank logs the same: the global batch's shares
    assert figures[0] == figures[1] and figures[0]["data/stage"] == 2.0
    # web is read on in its order where stage 0 left it: its samples, in global order, are its samples 0, 1, ...
    trained_web = [web_samples[s] for step in steps for s in step if s in web_samples]
    assert trained_web == list(range(len(trained_web)))
    # each rank's share of the replay stream: its own samples 0, 1, ..., in order, none repeated or skipped
    for r in range(DP):
        reference = PretrainingData.build(_cfg(sources, tmp_path), tokenizer, dp_rank=r, dp_size=DP).sources[1]
        mine = [s for step in steps[3:] for m in range(ACCUM) for s in step[(m * DP + r) * MBS:(m * DP + r + 1) * MBS]]
        replayed = [s for s in mine if s not in web_samples]
        assert replayed == [tuple(reference.get(j)[0][:-1].tolist()) for j in range(len(replayed))]


def test_stage_figures_count_the_steps_since_the_last_read(tokenizer, sources, tmp_path):
    data = PretrainingData.build(_cfg(sources, tmp_path), tokenizer, dp_rank=0, dp_size=1)
    for _ in range(3):
        data.next_step(1)
    assert data.stage_figures() == {"data/stage": 0.0, "data/source_share/web": 1.0, "data/source_share/replay": 0.0}
    data.next_step(1)
    assert data.stage_figures() == {"data/stage": 1.0, "data/source_share/web": 0.0, "data/source_share/replay": 1.0}


def test_one_stage_is_the_mixture_without_stages(tokenizer, sources, tmp_path):
    weighted = [DataSourceConfig(**{**vars(s), "weight": w}) for s, w in zip(sources, (1.0, 3.0))]
    plain = PretrainingData.build(_cfg(weighted, tmp_path, stages=[]), tokenizer, dp_rank=0, dp_size=1)
    staged = PretrainingData.build(_cfg(sources, tmp_path, stages=[DataStageConfig(1, [1.0, 3.0])]), tokenizer,
                                   dp_rank=0, dp_size=1)
    assert _steps([plain], 6) == _steps([staged], 6)


def test_resume_mid_stage_and_at_a_boundary_is_bitwise(tokenizer, sources, tmp_path):
    cfg = _cfg(sources, tmp_path)
    straight = _steps(_build(cfg, tokenizer), 10)
    for cut in (2, 3, 6):  # mid-stage 0; after stage 0's last step (step 4 opens stage 1); after stage 1's last
        first = _build(cfg, tokenizer)
        before = _steps(first, cut)
        state = json.loads(json.dumps(combine_rank_states(first[0], [d.rank_state() for d in first])))
        resumed = _build(cfg, tokenizer)
        for data in resumed:
            data.load_state_dict(state, steps_done=cut)
        assert before + _steps(resumed, 10 - cut) == straight, f"resumed after step {cut}"


def test_a_checkpoint_without_stages_resumes_and_a_changed_current_stage_opens_a_segment(tokenizer, sources, tmp_path):
    plain = _cfg(sources, tmp_path, stages=[])
    straight = _steps(_build(plain, tokenizer), 6)
    first = _build(plain, tokenizer)
    before = _steps(first, 3)
    state = combine_rank_states(first[0], [d.rank_state() for d in first])
    old = json.loads(json.dumps({k: v for k, v in state.items() if k not in ("segments", "steps")}))  # older version
    resumed = _build(plain, tokenizer)
    for data in resumed:
        data.load_state_dict(old, steps_done=3)
    assert before + _steps(resumed, 3) == straight
    # checkpoint.allow_data_change with the current stage's weights edited: this run's weights from the next step,
    # each source read on where it stopped (web's samples continue its order, none repeated)
    changed = _build(_cfg(sources, tmp_path, stages=[DataStageConfig(1, [1.0, 3.0])]), tokenizer)
    for data in changed:
        data.load_state_dict(json.loads(json.dumps(state)), steps_done=3)
    after = _steps(changed, 4)
    assert [s["first"] for s in changed[0].segments] == [0, 3 * ACCUM * DP * MBS]
    web = changed[0].sources[0]
    order = {tuple(web.get(j)[0][:-1].tolist()): j for j in range(web.size)}
    trained = [order[s] for step in straight[:3] + after for s in step if s in order]
    assert trained == list(range(len(trained))) and len(trained) < sum(len(step) for step in straight[:3] + after)


# ------------------------------------------------------------------------------------------- configuration
MINIMAL = ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok", "data.sources.0.path=a.jsonl",
           "data.sources.1.path=b.jsonl"]


@pytest.mark.parametrize("overrides, message", [
    (["data.stages=[{start_step: 2, weights: [1, 1]}]"],
     "data.stages.0.start_step=2: the first stage must start at step 1 (the stages cover the run from its first "
     "step); set data.stages.0.start_step=1"),
    (["data.stages=[{start_step: 1, weights: [1, 1]}, {start_step: 5, weights: [1, 0]}, {start_step: 5, weights: [0, 1]}]"],
     "data.stages.2.start_step=5 is not after data.stages.1.start_step=5: list the stages in order"),
    (["data.stages=[{start_step: 1, weights: [1, 1, 1]}]"],
     "data.stages.0.weights has 3 weight(s) for 2 data.sources: give one per source"),
    (["data.sources.0.label=web", "data.stages=[{start_step: 1, weights: {webb: 1}}]"],
     "data.stages.0.weights names 'webb', which is no data.sources.N.label (labels: web)"),
    (["data.stages=[{start_step: 1, weights: {web: 1}}]"],
     "data.stages.0.weights names 'web', which is no data.sources.N.label (labels: none: set data.sources.N.label)"),
    (["data.stages=[{start_step: 1, weights: [1, -0.5]}]"],
     "data.stages.0.weights.1=-0.5 must be a finite number >= 0"),
    (["data.sources.1.label=old", "data.stages=[{start_step: 1, weights: {old: many}}]"],
     "data.stages.0.weights.old must be a number, got str 'many'"),
    # issue 47 item 3: weights that each pass but whose sum overflows gave every source the share 0.000 in the dry
    # run, then numpy's "Probabilities do not sum to 1"; .inf was a type error; PyYAML reads 1.0e308 (no sign in the
    # exponent) as text, which the mapping form refused as not a number while the list form read it as one
    (["data.stages=[{start_step: 1, weights: [1.0e308, 1.0e308]}]"],
     "data.stages.0.weights [1e+308, 1e+308] sum to more than the largest number (1.8e+308): weights are relative "
     "(each is divided by their sum), so write them smaller, e.g. [1, 1] for equal shares"),
    (["data.sources.0.label=web", "data.sources.1.label=old", "data.stages=[{start_step: 1, weights: "
      "{web: 1.0e308, old: 1.0e308}}]"], "data.stages.0.weights [1e+308, 1e+308] sum to more than the largest number"),
    (["data.sources=[{path: a.jsonl, weight: 1e308}, {path: b.jsonl, weight: 1e308}]"],
     "data.sources.N.weight [1e+308, 1e+308] sum to more than the largest number"),
    (["data.stages=[{start_step: 1, weights: [.inf, 1]}]"], "data.stages.0.weights.0 must be a finite number, got inf"),
    (["data.stages=[{start_step: 1, weights: [1, 1]}, {start_step: 9, weights: [0, 0]}]"],
     "data.stages.1.weights are all 0: give at least one source a weight > 0 in every stage"),
    (["data.sources.0.label=web", "data.sources.1.label=web"],
     "data.sources.1.label='web' is also data.sources.0.label: a label names one source; rename one"),
    (["data.sources.0.label=web page"], "data.sources.0.label='web page' is not a name"),
])
def test_bad_stages_are_refused_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, MINIMAL + overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_stages_by_label_resolve_and_warnings_name_what_never_trains():
    from ntl_pretrain.trainer.preflight import config_warnings

    cfg = load_config(None, MINIMAL + [
        "data.sources.0.label=web", "data.sources.1.label=old", "data.sources.2.path=c.jsonl", "train.max_steps=100",
        "data.stages=[{start_step: 1, weights: {web: 1}}, {start_step: 50, weights: [0.7, 0.3, 0]}, "
        "{start_step: 200, weights: {old: 1}}]", "data.stages.1.weights.1=0.25"])  # an override into a stage
    assert [(s.start_step, s.weights) for s in cfg.data.stage_table()] == [
        (1, (1.0, 0.0, 0.0)), (50, (0.7, 0.25, 0.0)), (200, (0.0, 1.0, 0.0))]
    warnings = config_warnings(cfg)
    assert any(w.startswith("data.stages.2.start_step=200 is after train.max_steps=100") for w in warnings)
    assert any(w.startswith("data.sources.2 (c.jsonl) has weight 0 in every data.stages entry") for w in warnings)


def test_a_mapping_weight_pyyaml_reads_as_text_is_the_number_as_in_a_list():
    cfg = load_config(None, MINIMAL + ["data.sources.0.label=web", "data.sources.1.label=old",
                                       "data.stages=[{start_step: 1, weights: {web: 1.0e2, old: 3.0e2}}]"])
    assert [s.weights for s in cfg.data.stage_table()] == [(100.0, 300.0)]


def test_the_dry_run_refuses_weights_whose_sum_overflows(dry_run_here):
    result = dry_run_here("--config", "configs/cpt_replay_stages.yaml", "--world-size", "16",
                          "data.stages=[{start_step: 1, weights: [1.0e308, 1.0e308]}]")
    assert result.returncode != 0 and "dry run OK" not in result.stdout
    assert "data.stages.0.weights [1e+308, 1e+308] sum to more than the largest number" in result.stderr


def test_the_dry_run_prints_the_stage_table(dry_run_here):
    result = dry_run_here("--config", "configs/cpt_replay_stages.yaml", "--world-size", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout[result.stdout.index("# data stages"):].splitlines()
    assert table[1] == "#   stage 0: steps 1-1500: math 0.700, replay 0.300"
    assert table[2] == "#   stage 1: steps 1501-2000: math 0.500, replay 0.500"


# ------------------------------------------------------------------------------------------- resume policy
def _described(stages, weights=(1.0, 1.0)) -> dict:
    sources = [DataSourceConfig(path=f"/nonexistent/{name}.jsonl", weight=w, label=name)
               for name, w in zip(("web", "old"), weights)]
    return data_description(DataConfig(sources=sources, stages=[DataStageConfig(s, w) for s, w in stages]))


def test_a_resume_allows_edited_future_stages_and_refuses_edited_trained_ones(caplog):
    saved = _described([(1, [1, 0]), (100, [0.7, 0.3])])
    with caplog.at_level(logging.WARNING, logger="ntl_pretrain"):  # a later stage edited, one added
        check_data(saved, _described([(1, [1, 0]), (100, [0.5, 0.5]), (150, [0, 1])]), "ck", False, step=99)
    assert "other data stages after step 99" in caplog.text
    check_data(saved, _described([(1, [1, 0]), (120, [0.7, 0.3])]), "ck", False, step=99)  # stage 0 lasts longer
    for step, edited in [(100, [(1, [1, 0]), (100, [0.5, 0.5])]), (99, [(1, [1, 0]), (90, [0.7, 0.3])]),
                         (5, [(1, [1, 0.1]), (100, [0.7, 0.3])])]:
        with pytest.raises(CheckpointError, match=f"Keep the stages that start at or before step {step} as they were"):
            check_data(saved, _described(edited), "ck", False, step=step)
    # a checkpoint of a run without stages: its mixture is stage 0 of a staged run that keeps its weights
    plain = _described([], weights=(1.0, 3.0))
    check_data(plain, _described([(1, [1.0, 3.0]), (50, [0, 1])], weights=(1.0, 3.0)), "ck", False, step=40)
    with pytest.raises(CheckpointError, match=r"trained steps 1-40 with data stages that this run changes \(data.stages.0: "
                       r"from step 1, weights \[1.0, 3.0\] -> from step 1, weights \[1.0, 1.0\]\)"):
        check_data(plain, _described([(1, [1.0, 1.0]), (50, [0, 1])], weights=(1.0, 3.0)), "ck", False, step=40)


def _validation(ranks: list[PretrainingData], batches: int) -> list[list[tuple]]:
    """Per rank, its validation plan: (the micro-batch's rows, its source, whether the mixture counts it)."""
    return [[(tuple(map(tuple, batch.input_ids.tolist())), source, counted)
             for batch, source, counted in data.validation_plan(batches)] for data in ranks]


VAL_DOCUMENTS = 14


@pytest.mark.parametrize("batches", [1, 2, 50])
def test_validation_per_source_is_each_sources_own_held_out_samples_across_stages_and_resume(
        tokenizer, sources, tmp_path, batches):
    cfg = _cfg(sources, tmp_path, validation_documents=VAL_DOCUMENTS)
    ranks = _build(cfg, tokenizer)
    plans = _validation(ranks, batches)
    assert len({len(plan) for plan in plans}) == 1  # every rank runs as many forwards
    # the reference: each source's held-out samples as a run of that source alone holds them out
    held = []
    for source in sources:
        alone = PretrainingData.build(_cfg([source], tmp_path, [], VAL_DOCUMENTS), tokenizer, dp_rank=0, dp_size=1)
        rows = [tuple(tokens[:-1].tolist()) for tokens, _ in alone.validation]
        held.append(rows)
    assert [len(rows) for rows in held] == [13, 10]  # web's 13th sample is short of a whole micro-batch:
    held = [rows[: len(rows) // MBS * MBS] for rows in held]  # left out (so no micro-batch mixes sources)
    for i, rows in enumerate(held):
        validated = [row for plan in plans for batch, source, _ in plan if source == i for row in batch]
        assert sorted(validated) == sorted(rows[: batches * MBS * DP]), f"source {i}"
    # the mixture: the first `batches` global batches of the sources' held-out samples in order, as before
    mixture = [row for rows in held for row in rows]
    count = min(batches, len(mixture) // (MBS * DP))
    counted = [[batch for batch, _, c in plan if c] for plan in plans]
    assert all(len(c) == count for c in counted)
    assert [row for m in range(count) for r in range(DP) for row in counted[r][m]] == mixture[: count * MBS * DP]
    # stages change nothing validated, nor do steps trained, nor a resume
    weighted = [DataSourceConfig(**{**vars(s), "weight": 1.0}) for s in sources]
    assert _validation(_build(_cfg(weighted, tmp_path, [], VAL_DOCUMENTS), tokenizer), batches) == plans
    _steps(ranks, 5)
    state = json.loads(json.dumps(combine_rank_states(ranks[0], [d.rank_state() for d in ranks])))
    resumed = _build(cfg, tokenizer)
    for data in resumed:
        data.load_state_dict(state, steps_done=5)
    assert _validation(ranks, batches) == plans and _validation(resumed, batches) == plans
