"""Evaluation inputs checked before training: a broken GSM8K line, a length budget with no room for the prompt,
misspelt generated-corpus options and benchmark digits that disagree with the corpus: one clear line at
config load, in --dry-run and at the trainer's start-up, never a raw error after training."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.distributed import free_port
from helpers.launch import launch_env, run

from ntl_pretrain.config import ConfigError, load_config
from ntl_pretrain.eval.config import EvalConfig

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # one test starts bash launch/pretrain.sh
MINIMAL = ["model.architecture={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
           "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}",
           "tokenizer.name_or_path=tok", "data.sources=[{path: corpus.jsonl, generate_arithmetic: 100}]"]


def _gsm8k_folder(folder: Path, broken_line: int | None = None, split: str = "test") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train", "test"):
        rows = [json.dumps({"question": f"Ann has {i} pens and finds 1 more. How many pens?",
                            "answer": f"{i}+1={i + 1}\n#### {i + 1}"}) for i in range(8)]
        if name == split and broken_line is not None:
            rows[broken_line - 1] = rows[broken_line - 1][:-5]  # a cut-off line, as an interrupted download leaves
        (folder / f"{name}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


@pytest.mark.parametrize("split", ["test", "train"])
def test_broken_gsm8k_line_is_named_with_file_and_line(tmp_path, split):
    from ntl_pretrain.eval.config import validate_eval_inputs

    folder = _gsm8k_folder(tmp_path / "gsm8k", broken_line=5, split=split)
    cfg = EvalConfig(gsm8k_path=str(folder))
    with pytest.raises(ValueError, match=rf"GSM8K file {folder / (split + '.jsonl')} line 5 is not valid JSON"):
        validate_eval_inputs(cfg)
    good = _gsm8k_folder(tmp_path / "good")
    checked = validate_eval_inputs(EvalConfig(gsm8k_path=str(good)))
    assert checked == [f"GSM8K test: {good / 'test.jsonl'} (8 rows)", f"GSM8K train: {good / 'train.jsonl'} (8 rows)"]
    (good / "test.jsonl").write_text('{"question": "no answer field"}\n', encoding="utf-8")
    from ntl_pretrain.eval.gsm8k import load_gsm8k

    with pytest.raises(ValueError, match="line 1 is not an object with string 'question' and 'answer'"):
        load_gsm8k(str(good / "test.jsonl"))


def test_length_budget_without_room_for_the_prompt_is_refused_by_key():
    from ntl_pretrain.eval.config import validate_eval_inputs

    with pytest.raises(ValueError, match=r"eval.gsm8k_max_new_tokens=256 leaves no room for the prompt within 256 "
                                         r"tokens \(the model's max_position_embeddings\)"):
        validate_eval_inputs(EvalConfig(gsm8k_path="openai/gsm8k"), max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"eval.arithmetic_max_new_tokens=16 .* within 16 tokens \(eval.max_length\)"):
        validate_eval_inputs(EvalConfig(max_length=16))
    assert validate_eval_inputs(EvalConfig(gsm8k_path="openai/gsm8k"), max_position_embeddings=2048) == []


def test_cot_exemplars_from_a_users_file(tmp_path):
    from ntl_pretrain.eval.config import validate_eval_inputs

    exemplars = tmp_path / "cot.yaml"
    exemplars.write_text("- {question: 'Two plus two?', target: 'Two plus two is 4. The answer is 4.'}\n")
    cfg = EvalConfig(gsm8k_path=str(_gsm8k_folder(tmp_path / "gsm8k")), gsm8k_variant="gsm8k_cot",
                     gsm8k_cot_exemplars=str(exemplars), num_fewshot=1)
    assert validate_eval_inputs(cfg)[-1] == f"gsm8k_cot exemplars: {exemplars} (1)"
    from ntl_pretrain.eval.gsm8k import build_prompts, load_gsm8k

    prompt = build_prompts(load_gsm8k(cfg.gsm8k_path), [], variant="gsm8k_cot", num_fewshot=1,
                           cot_exemplars=str(exemplars))[0].prompt
    assert prompt.startswith("Q: Two plus two?\nA: Two plus two is 4. The answer is 4.\n\nQ: Ann has 0 pens")
    with pytest.raises(ValueError, match="number 1; set eval.num_fewshot to at most 1"):
        validate_eval_inputs(EvalConfig(**{**cfg.__dict__, "num_fewshot": None}))  # the default 8
    with pytest.raises(ValueError, match="neither 'lm_eval', 'project' nor an existing file"):
        validate_eval_inputs(EvalConfig(**{**cfg.__dict__, "gsm8k_cot_exemplars": str(tmp_path / "none.yaml")}))


def test_misspelt_generate_options_key_is_rejected_at_config_load_with_the_nearest_key():
    with pytest.raises(ConfigError, match=r"data.sources.0.generate_options.train_digit is not a corpus option; "
                                          r"did you mean data.sources.0.generate_options.train_digits\?"):
        load_config(None, MINIMAL + ["data.sources.0.generate_options={train_digit: [1, 2]}"])
    with pytest.raises(ConfigError, match=r"generate_options.text_share=1.5 must be a number in \[0, 1\]"):
        load_config(None, MINIMAL + ["data.sources.0.generate_options={text_share: 1.5}"])
    with pytest.raises(ConfigError, match=r"generate_options: unknown arithmetic ops \['/'\]"):
        load_config(None, MINIMAL + ["data.sources.0.generate_options={ops: ['/']}"])


def test_benchmark_digits_must_match_the_generated_corpus():
    corpus = "data.sources.0.generate_options={train_digits: [1, 2]}"
    with pytest.raises(ConfigError, match=r"eval.arithmetic_train_digits=\[1, 4\] but data.sources.0.generate_options"
                                          r".train_digits=\[1, 2\] \(the corpus this run generates\)"):
        load_config(None, MINIMAL + [corpus])
    cfg = load_config(None, MINIMAL + [corpus, "eval.arithmetic_train_digits=[1, 2]",
                                       "eval.arithmetic_extrapolation_digits=[3, 3]"])
    assert cfg.eval.arithmetic_train_digits == [1, 2]
    load_config(None, MINIMAL + [corpus, "eval.arithmetic_n=0"])  # no arithmetic benchmark: nothing to match


def test_dry_run_reads_the_gsm8k_files_and_names_a_broken_line(tmp_path, dry_run_here):
    """Five dry runs of the trainer's command line, in this process (tests/conftest.py `dry_run_here`)."""

    def _dry_run(args: list[str]):
        return dry_run_here(*args)

    folder = _gsm8k_folder(tmp_path / "gsm8k", broken_line=3)
    room = "eval.gsm8k_max_new_tokens=64"
    result = _dry_run(["--config", "configs/demo.yaml", "--world-size", "2", f"eval.gsm8k_path={folder}", room])
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: GSM8K file {folder / 'test.jsonl'} line 3 is not valid JSON (") and \
        last.endswith("): fix or remove that line"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    result = _dry_run(["--config", "configs/demo.yaml", "--world-size", "2", f"eval.gsm8k_path={tmp_path / 'none'}",
                       room])
    assert result.returncode == 2 and f"error: eval.gsm8k_path='{tmp_path / 'none'}' does not exist" in result.stderr
    (tmp_path / "only_test").mkdir()
    (tmp_path / "only_test" / "test.jsonl").write_text((folder / "train.jsonl").read_text())
    result = _dry_run(["--config", "configs/demo.yaml", "--world-size", "2", f"eval.gsm8k_path={tmp_path / 'only_test'}",
                       room])
    assert result.returncode == 2 and "error: GSM8K train split not found" in result.stderr
    # the demo model has 256 positions and gsm8k_max_new_tokens is 256: no room for a prompt
    good = _gsm8k_folder(tmp_path / "good")
    result = _dry_run(["--config", "configs/demo.yaml", "--world-size", "2", f"eval.gsm8k_path={good}"])
    assert result.returncode == 2 and "eval.gsm8k_max_new_tokens=256 leaves no room" in result.stderr
    result = _dry_run(["--config", "configs/demo.yaml", "--world-size", "2", f"eval.gsm8k_path={good}", room])
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"# evaluation input OK: GSM8K test: {good / 'test.jsonl'} (8 rows)" in result.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_trainer_refuses_a_broken_gsm8k_file_before_training(tmp_path):
    from test_eval_tool import TINY_RUN

    run_dir, assets = tmp_path / "run", tmp_path / "assets"
    folder = _gsm8k_folder(tmp_path / "gsm8k", broken_line=2, split="train")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_RUN.replace("ASSETS", str(assets)).replace("RUN", str(run_dir)), encoding="utf-8")
    env = launch_env(NTL_CPU_PROCS="1", NTL_DEEPSPEED_ARGS=f"--master_port {free_port()}")
    command = ["bash", str(REPO / "launch" / "pretrain.sh"), "--config", str(config), "parallel.tp_size=1",
               f"eval.gsm8k_path={folder}", "eval.gsm8k_max_new_tokens=8"]
    done = run(command, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode != 0
    assert f"GSM8K file {folder / 'train.jsonl'} line 2 is not valid JSON" in done.stderr, done.stderr[-3000:]
    assert "ArrowInvalid" not in done.stderr and "Traceback" not in done.stderr
    assert not list(run_dir.glob("global_step*")) and not (run_dir / "tensorboard").exists()  # before training


def test_a_generated_corpus_holding_interpolation_problems_is_refused(tmp_path):
    from ntl_pretrain.eval.arithmetic import generate_problems, write_training_corpus
    from ntl_pretrain.eval.config import validate_eval_inputs

    corpus = tmp_path / "arithmetic.jsonl"
    write_training_corpus(str(corpus), n=2000, seed=5, train_digits=(1, 2), ops=("+", "-"))
    cfg = EvalConfig(arithmetic_train_digits=[1, 2], arithmetic_extrapolation_digits=[3, 3], arithmetic_ops=["+", "-"])
    where = [("data.sources.0.path", str(corpus))]
    assert validate_eval_inputs(cfg, generated_corpora=where) == [f"generated corpus {corpus}: no interpolation problem"]
    # a corpus written before the canonical split (or by hand) that holds a held-out problem, e.g. a commuted twin
    held_out = generate_problems("interpolation", 1, seed=5, ops=("+",), train_digits=(1, 2),
                                 extrapolation_digits=(3, 3))[0]
    with open(corpus, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": held_out.text}) + "\n")
    with pytest.raises(ValueError, match=rf"holds 1 problems of the interpolation split \(e.g. '{re.escape(held_out.text)}'\)"
                                         r".*delete it and it is generated again"):
        validate_eval_inputs(cfg, generated_corpora=where)
    assert validate_eval_inputs(EvalConfig(arithmetic_n=0), generated_corpora=where) == []


@pytest.mark.parametrize("pointer", ["../../elsewhere", "global_step3/../../x", ""])
def test_a_latest_file_that_names_no_tag_of_the_run_is_named(tmp_path, capsys, pointer):
    """Issue 40 item 12: `latest` pointing outside the run folder gave a message about train.resume='../../...',
    a setting the user never gave; the `latest` file is named, and nothing outside the run is read."""
    import runpy

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("train: {}\n")
    (run_dir / "latest").write_text(pointer + "\n")
    tool = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "evaluate.py"))
    assert tool["main"](["--run", str(run_dir)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{str(run_dir / 'latest')!r} names {pointer!r}" in err[0], err
    assert "train.resume" not in err[0] and "--tag global_stepN" in err[0]
