"""ShardedLM (ntl_pretrain/eval/lm_eval_model.py) against lm-evaluation-harness's own Hugging Face backend (HFLM) on
the exported model: the same per-request results (log-likelihoods to float32 rounding, the same greedy flags and
generations) and the same task metrics, for a multiple-choice task (loglikelihood), a perplexity task
(loglikelihood_rolling, several windows per document) and a generation task (generate_until): in one process, and
on 4 processes under ZeRO-3 with AutoTP T=2 (vocabulary-parallel head) and dp=2. The tasks are the local demo tasks
(examples/lm_eval_tasks: YAMLs and JSON lines, no hub)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from helpers.distributed import finish_ranks, start_ranks

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = REPO / "examples" / "lm_eval_tasks"
TASKS = ["ntl_demo_choice", "ntl_demo_text", "ntl_demo_arithmetic"]
# 3 documents: 9 multiple-choice requests split 5/4 over dp=2 (3 and 2 batches of 2: the second rank runs idle
# forwards); a 64-token window splits each ~100-character text into two rolling windows and truncates nothing else
LIMIT, BATCH_SIZE, MAX_LENGTH = 3, 2, 64
WORKER_TIMEOUT_S = 600


def eval_settings():
    """The run's eval section with only the lm_eval benchmark on."""
    from ntl_pretrain.eval.config import EvalConfig

    return EvalConfig(arithmetic_n=0, lm_eval_tasks=TASKS, lm_eval_include_path=str(TASKS_DIR), lm_eval_limit=LIMIT,
                      lm_eval_max_gen_toks=16, batch_size=BATCH_SIZE, max_length=MAX_LENGTH)


def request_results(results: dict) -> dict:
    """{task: every request's response, in document order} from lm-eval's logged samples (JSON-able)."""
    return {task: json.loads(json.dumps([sample["resps"] for sample in samples]))
            for task, samples in results["samples"].items()}


def assert_same_requests(ours: dict, theirs: dict) -> None:
    """Log-likelihoods equal to float32 rounding; greedy flags and generated texts identical."""
    assert ours.keys() == theirs.keys() == set(TASKS)

    def flat(value):
        return [x for item in value for x in flat(item)] if isinstance(value, (list, tuple)) else [value]

    for task in TASKS:
        mine, reference = flat(ours[task]), flat(theirs[task])
        assert len(mine) == len(reference) > 0, task
        for a, b in zip(mine, reference):
            if isinstance(b, float):
                assert a == pytest.approx(b, rel=2e-6, abs=2e-5), task
            else:
                assert a == b, task


def assert_same_metrics(ours: dict, theirs: dict) -> None:
    """Accuracies and exact matches identical; perplexities (exponentials of the summed log-likelihoods) to float32
    rounding."""
    assert ours.keys() == theirs.keys()
    for tag, value in theirs.items():
        if "perplexity" in tag or "bits_per_byte" in tag:
            assert ours[tag] == pytest.approx(value, rel=1e-5), tag
        else:
            assert ours[tag] == value, tag


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny model saved as an HF folder (as tools/export_hf.py writes one), and lm-eval's HFLM on that folder."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    from helpers.models import char_tokenizer, eval_llama
    from ntl_pretrain.eval.benchmarks.lm_eval import LM_EVAL, load_tasks, metric_tags

    folder = tmp_path_factory.mktemp("export")
    tokenizer = char_tokenizer()
    eval_llama(len(tokenizer), seed=0, initializer_range=0.3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    harness = HFLM(pretrained=str(folder), batch_size=BATCH_SIZE, max_length=MAX_LENGTH, device="cpu")
    settings = eval_settings().settings_of(LM_EVAL)
    results = evaluate(lm=harness, task_dict=load_tasks(settings), limit=LIMIT, bootstrap_iters=0, log_samples=True)
    return {"folder": folder, "requests": request_results(results),
            "metrics": metric_tags(results["results"], "eval/lm_eval")}


def test_the_reference_exercises_every_request_kind(exported):
    requests = exported["requests"]
    assert [len(requests[task]) for task in TASKS] == [LIMIT] * 3
    assert all(len(choices) == 3 for choices in requests["ntl_demo_choice"])  # 3 loglikelihood requests a document
    assert all(isinstance(text, str) for [[text]] in requests["ntl_demo_arithmetic"])
    assert any(text for [[text]] in requests["ntl_demo_arithmetic"])  # something generated, cut at the line end
    assert {"eval/lm_eval/ntl_demo_choice/acc", "eval/lm_eval/ntl_demo_text/word_perplexity",
            "eval/lm_eval/ntl_demo_arithmetic/exact_match"} <= exported["metrics"].keys()


def test_one_process_equals_hflm_on_the_export(exported, tmp_path: Path):
    from lm_eval.evaluator import evaluate
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.eval.benchmarks.lm_eval import LM_EVAL, load_tasks
    from ntl_pretrain.eval.hooks import predictions_path, run_evaluation
    from ntl_pretrain.eval.lm_eval_model import ShardedLM
    from ntl_pretrain.tokenizer.loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(exported["folder"]).eval()
    tokenizer = load_tokenizer(str(exported["folder"]))
    cfg = eval_settings()
    lm = ShardedLM(model, tokenizer, batch_size=BATCH_SIZE, max_length=MAX_LENGTH)
    results = evaluate(lm=lm, task_dict=load_tasks(cfg.settings_of(LM_EVAL)), limit=LIMIT, bootstrap_iters=0,
                       log_samples=True)
    assert_same_requests(request_results(results), exported["requests"])

    # the benchmark in the evaluation hook (the training loop's and tools/evaluate.py's path): the same metrics
    metrics = run_evaluation(model, tokenizer, cfg, step=5, output_dir=str(tmp_path))
    assert_same_metrics({k: v for k, v in metrics.items() if k.startswith("eval/lm_eval/")}, exported["metrics"])
    lines = [json.loads(line) for line in open(predictions_path(str(tmp_path), 5), encoding="utf-8")]
    assert sorted({line["task"] for line in lines}) == sorted(TASKS) and len(lines) == 3 * LIMIT
    assert all(line["benchmark"] == "lm_eval" for line in lines)


def test_tools_evaluate_runs_the_tasks_on_an_export(exported, tmp_path: Path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ntl_evaluate_tool", REPO / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--model", str(exported["folder"]), "--output-dir", str(tmp_path), "arithmetic_n=0",
                      f"lm_eval_tasks=[{', '.join(TASKS)}]", f"lm_eval_include_path={TASKS_DIR}",
                      f"lm_eval_limit={LIMIT}", "lm_eval_max_gen_toks=16", f"batch_size={BATCH_SIZE}",
                      f"max_length={MAX_LENGTH}"]) == 0
    assert "eval/lm_eval/ntl_demo_choice/acc" in capsys.readouterr().out
    result = json.loads((tmp_path / "eval_results_step_0000000.json").read_text())
    assert_same_metrics({k: v for k, v in result["metrics"].items() if k.startswith("eval/lm_eval/")},
                        exported["metrics"])


def test_a_sampling_request_and_an_unknown_task_are_refused_in_one_line(exported):
    from types import SimpleNamespace

    from ntl_pretrain.eval.config import EvalConfig, validate_eval_inputs
    from ntl_pretrain.eval.lm_eval_model import ShardedLM
    from helpers.models import char_tokenizer, eval_llama

    tokenizer = char_tokenizer()
    lm = ShardedLM(eval_llama(len(tokenizer)), tokenizer, max_length=MAX_LENGTH)
    with pytest.raises(ValueError, match="ShardedLM decodes greedily"):
        lm.generate_until([SimpleNamespace(args=("1+1=", {"do_sample": True, "temperature": 0.7}))])
    with pytest.raises(ValueError, match="max_gen_toks=64 leaves no room"):
        lm.generate_until([SimpleNamespace(args=("1+1=", {"max_gen_toks": 64}))])
    # at start-up: the trainer's and tools/evaluate.py's input checks
    checked = validate_eval_inputs(eval_settings())
    assert checked == [f"lm-eval tasks: {', '.join(TASKS)} (lm-eval 0.4.13)"]
    cfg = EvalConfig(arithmetic_n=0, lm_eval_tasks=["ntl_demo_choise"], lm_eval_include_path=str(TASKS_DIR))
    with pytest.raises(ValueError, match=r"names 'ntl_demo_choise' \(did you mean 'ntl_demo_choice'\?\)") as error:
        validate_eval_inputs(cfg)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="holds an empty or repeated name"):
        EvalConfig(lm_eval_tasks=["a", "a"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(WORKER_TIMEOUT_S + 60)
def test_zero3_tp2_dp2_equals_hflm_on_the_export(exported, tmp_path: Path):
    """4 ranks: ZeRO-3, AutoTP T=2 with the vocabulary-parallel head, dp=2; every rank returns every result."""
    worker = REPO / "tests" / "workers" / "lm_eval_shards.py"
    procs = start_ranks([sys.executable, str(worker), str(exported["folder"]), "2", str(tmp_path)], 4)
    outputs = finish_ranks(procs, WORKER_TIMEOUT_S, "the 4 ShardedLM ranks")
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    assert not failed, "\n----\n".join(out[-3000:] for out, _ in outputs)
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (result["tp_size"], result["dp_size"]) == (2, 2), rank
        assert_same_requests(result["requests"], exported["requests"])
        assert_same_metrics(result["metrics"], exported["metrics"])
        assert not any(math.isnan(v) for v in result["metrics"].values())
