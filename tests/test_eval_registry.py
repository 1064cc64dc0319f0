"""The benchmark registry: a benchmark defined here, in the test, joins the registry and runs through the hooks
(TensorBoard, predictions file, shared generation figures) and through tools/evaluate.py (settings, start-up
checks, progress, results JSON), its outputs checked against the naive greedy reference."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.launch import REPO
from helpers.models import char_tokenizer, eval_llama
from helpers.tensorboard import scalars, tensor_tags
from ntl_pretrain.eval import config as eval_config
from ntl_pretrain.eval.benchmarks import BENCHMARKS, Benchmark, BenchmarkResult
from ntl_pretrain.eval.benchmarks.base import check_at_least, setting
from ntl_pretrain.eval.hooks import predictions_path, run_evaluation
from test_eval_generate import naive_greedy

ECHO_PROMPTS = ("12+3=", "a", "7-8=", "the answer is", "q: what?")


@dataclass
class EchoSettings:
    echo_n: int = setting("prompts of the echo benchmark (0: skip it)", default=0)
    echo_max_new_tokens: int = setting("tokens generated at most per echo prompt", default=6)

    def __post_init__(self) -> None:
        check_at_least(self, 0, "echo_n")
        check_at_least(self, 1, "echo_max_new_tokens")


class EchoBenchmark(Benchmark):
    """Continues fixed prompts; its metric is the mean length of the continuations."""

    name = "echo"
    Settings = EchoSettings
    max_new_tokens_key = "echo_max_new_tokens"

    def enabled(self, settings: EchoSettings) -> bool:
        return settings.echo_n > 0

    def check_inputs(self, settings, inputs) -> list[str]:
        return [f"echo: {settings.echo_n} built-in prompts"]

    def run(self, model, tokenizer, settings, context) -> BenchmarkResult:
        prompts = ECHO_PROMPTS[:settings.echo_n]
        generation = context.generate(model, tokenizer, prompts, label=self.name, what=f"{len(prompts)} prompts",
                                      max_new_tokens=settings.echo_max_new_tokens, stop=("\n",),
                                      add_special_tokens=context.add_special_tokens)
        records = [{"benchmark": self.name, "prompt": prompt, "output": output, "extracted": len(output), "gold": None,
                    "correct": None} for prompt, output in zip(prompts, generation.texts)]
        metrics = {f"eval/{self.name}/mean_chars": sum(len(text) for text in generation.texts) / len(prompts),
                   f"eval/{self.name}/n": float(len(prompts))}
        return BenchmarkResult(metrics, records, generation)


EchoEvalConfig = eval_config.eval_config_class((*BENCHMARKS, EchoBenchmark()))


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = char_tokenizer()
    return eval_llama(len(tokenizer), seed=4, initializer_range=0.3), tokenizer


def _echo_reference(model, tokenizer, n: int, max_new_tokens: int) -> list[str]:
    return [naive_greedy(model, tokenizer, prompt, max_new_tokens, ("\n",))[0] for prompt in ECHO_PROMPTS[:n]]


def test_the_registry_gives_the_config_its_keys_and_checks():
    names = [f.name for f in dataclasses.fields(EchoEvalConfig)]
    builtin = [f.name for f in dataclasses.fields(eval_config.EvalConfig)]
    # the new benchmark's keys after the built-in benchmarks' and before the shared generation keys
    assert names == builtin[:-4] + ["echo_n", "echo_max_new_tokens"] + builtin[-4:]
    assert [f.name for f in dataclasses.fields(eval_config.SharedSettings)] == builtin[-4:]
    with pytest.raises(ValueError, match=r"eval.echo_n=-1 must be >= 0"):
        EchoEvalConfig(echo_n=-1)
    cfg = EchoEvalConfig(arithmetic_n=0, echo_n=2, echo_max_new_tokens=64)
    assert eval_config.validate_eval_inputs(cfg) == ["echo: 2 built-in prompts"]
    with pytest.raises(ValueError, match=r"eval.echo_max_new_tokens=64 leaves no room for the prompt within 64 tokens"):
        eval_config.validate_eval_inputs(cfg, max_position_embeddings=64)
    # settings of two benchmarks must not share a key, nor two benchmarks a name
    with pytest.raises(ValueError, match=r"benchmark names \['echo', 'echo'\] repeat"):
        eval_config.eval_config_class((EchoBenchmark(), EchoBenchmark()))
    echo_again = type("EchoAgain", (EchoBenchmark,), {"name": "echo_again"})()
    with pytest.raises(ValueError, match="'echo_n' is both EchoSettings's and EchoSettings's"):
        eval_config.eval_config_class((EchoBenchmark(), echo_again))


def test_a_registered_benchmark_runs_through_the_hooks(model_and_tokenizer, tmp_path: Path):
    from torch.utils.tensorboard import SummaryWriter

    model, tokenizer = model_and_tokenizer
    arithmetic = dict(arithmetic_n=3, arithmetic_ops=["+"], batch_size=2, samples_to_log=2)
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    metrics = run_evaluation(model, tokenizer, EchoEvalConfig(echo_n=4, **arithmetic), step=3,
                             output_dir=str(tmp_path / "both"), writer=writer)
    writer.close()
    outputs = _echo_reference(model, tokenizer, 4, 6)
    assert metrics["eval/echo/mean_chars"] == sum(map(len, outputs)) / 4 and metrics["eval/echo/n"] == 4
    lines = [json.loads(line) for line in open(predictions_path(str(tmp_path / "both"), 3), encoding="utf-8")]
    assert [line["output"] for line in lines if line["benchmark"] == "echo"] == outputs
    logged = scalars(tmp_path / "tb")
    assert logged["eval/echo/mean_chars"] == [(3, pytest.approx(metrics["eval/echo/mean_chars"]))]
    assert "eval/samples/echo/text_summary" in tensor_tags(tmp_path / "tb")

    # the built-in benchmarks are untouched by the extra one, and the shared figures count its generation too
    alone = run_evaluation(model, tokenizer, eval_config.EvalConfig(**arithmetic), step=3, output_dir=str(tmp_path / "a"))
    echo_only = run_evaluation(model, tokenizer, EchoEvalConfig(echo_n=4, arithmetic_n=0), step=3,
                               output_dir=str(tmp_path / "e"))
    assert {k: v for k, v in metrics.items() if k.startswith("eval/arith/")} == pytest.approx(
        {k: v for k, v in alone.items() if k.startswith("eval/arith/")}, nan_ok=True)
    assert metrics["eval/generation/tokens"] == alone["eval/generation/tokens"] + echo_only["eval/generation/tokens"]
    assert [k for k in echo_only if k.startswith("eval/arith/")] == []  # arithmetic_n=0 skips it


def test_a_registered_benchmark_runs_through_tools_evaluate(model_and_tokenizer, tmp_path: Path, capsys, monkeypatch):
    model, tokenizer = model_and_tokenizer
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    spec = importlib.util.spec_from_file_location("ntl_evaluate_tool", REPO / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    # register: the tool and the settings reader use the config built from the registry with the new benchmark
    monkeypatch.setattr(eval_config, "EvalConfig", EchoEvalConfig)
    monkeypatch.setattr(tool, "EvalConfig", EchoEvalConfig)

    assert "echo: echo_n, echo_max_new_tokens" in tool.settings_help()
    assert tool.main(["--model", str(tmp_path / "model"), "echo_n=-1"]) == 2
    assert "error: eval.echo_n=-1 must be >= 0" in capsys.readouterr().err
    assert tool.main(["--model", str(tmp_path / "model"), "--output-dir", str(tmp_path / "out"), "arithmetic_n=0",
                      "echo_n=5", "echo_max_new_tokens=4", "batch_size=2"]) == 0
    printed = capsys.readouterr().out
    assert "eval echo: 5 prompts" in printed and "eval echo: 3/3 batches" in printed
    assert "eval/echo/mean_chars" in printed
    result = json.loads((tmp_path / "out" / "eval_results_step_0000000.json").read_text())
    outputs = _echo_reference(model, tokenizer, 5, 4)
    assert result["metrics"]["eval/echo/mean_chars"] == sum(map(len, outputs)) / 5
    assert result["eval_config"]["echo_n"] == 5 and "eval/arith/interpolation/accuracy" not in result["metrics"]
    lines = (tmp_path / "out" / "eval" / "step_0000000.jsonl").read_text().splitlines()
    assert [json.loads(line)["output"] for line in lines] == outputs


def test_a_benchmark_setting_below_its_minimum_is_a_config_error():
    """A benchmark's `check_at_least` raises ConfigError (one line naming the key, as every config error)."""
    from ntl_pretrain.config import ConfigError, load_config

    for key in ("arithmetic_n", "gsm8k_limit"):
        with pytest.raises(ConfigError, match=rf"^eval.{key}=-1 must be >= 0$"):
            load_config(str(REPO / "configs" / "demo.yaml"), [f"eval.{key}=-1"])
