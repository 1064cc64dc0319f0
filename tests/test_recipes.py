"""docs/architecture.md's recipes, each made in a temporary copy of the project and checked there in a fresh
process: a new learning-rate schedule and a new loss head are each one table entry, a new NTL variant with an option
of its own one new module, a new NTL variant without options one module plus its reference, a new benchmark one
module plus its registry line, a new model family one table entry plus its tiny model and its docs row (the diff is
counted); the tests that read the registries then run in the copy and pass (the new variant's without a line of them
edited)."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _copy_package(tmp_path: Path) -> None:
    shutil.copytree(REPO / "ntl_pretrain", tmp_path / "ntl_pretrain", ignore=shutil.ignore_patterns("__pycache__"))


def _copy_with_entry(tmp_path: Path, module: str, anchor: str, entry: str) -> list[str]:
    """Copy ntl_pretrain/ to `tmp_path`, add `entry` to `module` after the line `anchor`; the changed lines."""
    _copy_package(tmp_path)
    path = tmp_path / "ntl_pretrain" / module
    before = path.read_text(encoding="utf-8")
    assert before.count(anchor + "\n") == 1, anchor
    path.write_text(before.replace(anchor + "\n", anchor + "\n" + entry), encoding="utf-8")
    changed = difflib.unified_diff(before.splitlines(), path.read_text(encoding="utf-8").splitlines(), lineterm="", n=0)
    return [line for line in changed if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def _run_in_copy(tmp_path: Path, check: str) -> str:
    environment = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    script = "import ntl_pretrain\nassert ntl_pretrain.__file__.startswith(%r), ntl_pretrain.__file__\n" % str(tmp_path)
    result = subprocess.run([sys.executable, "-c", script + textwrap.dedent(check)], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.fast
def test_a_new_lr_schedule_is_one_entry(tmp_path):
    """A log warm-up to a constant lr (DeepSpeed's WarmupLR with warmup_type=log) as one `LR_SCHEDULES` entry: the
    config takes the name, --help shows it, a key it does not read is refused with it, and DeepSpeed's scheduler
    built from the generated section reaches optim.lr after the warm-up."""
    changed = _copy_with_entry(tmp_path, "core/lr_schedules.py", "LR_SCHEDULES: dict[str, LRSchedule] = {",
                               '    "log_warmup": LRSchedule(lambda optim, warmup, total: {"type": "WarmupLR", "params": {'
                               '"warmup_num_steps": warmup, "warmup_min_lr": 0.0, "warmup_max_lr": optim.lr, '
                               '"warmup_type": "log"}}, "WarmupLR, a log warm-up"),\n')
    assert len(changed) == 1
    out = _run_in_copy(tmp_path, f"""
        import torch
        from ntl_pretrain.config import ConfigError, load_config
        from ntl_pretrain.config.parsing import help_text
        from ntl_pretrain.core.lr_schedules import scheduler_class
        from ntl_pretrain.trainer.ds_config import deepspeed_config
        demo = {str(REPO / "configs" / "demo.yaml")!r}
        cfg = load_config(demo, ["optim.lr_schedule=log_warmup", "parallel.tp_size=1", "optim.warmup_steps=4",
                                 "optim.lr=0.002"])
        section = deepspeed_config(cfg, on_cpu=True)["scheduler"]  # checked by DeepSpeed's own config too
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = scheduler_class(section["type"])(optimizer, **section["params"])
        for _ in range(6):
            scheduler.step()
        assert abs(optimizer.param_groups[0]["lr"] - 0.002) < 1e-12, optimizer.param_groups[0]["lr"]
        assert "log_warmup (WarmupLR, a log warm-up)" in help_text()
        try:
            load_config(demo, ["optim.lr_schedule=log_warmup", "parallel.tp_size=1", "optim.min_lr_ratio=0.2"])
        except ConfigError as error:
            print(error)
        """)
    assert "optim.min_lr_ratio=0.2 has no effect with optim.lr_schedule=log_warmup" in out


@pytest.mark.fast
def test_a_new_loss_head_is_one_entry(tmp_path):
    """A head that answers every `loss` section, entered before the others: the objective picks it, the log names
    it, and the training step's call reaches it (its sums: the full-logits head's after a line, on a tiny Llama)."""
    changed = _copy_with_entry(tmp_path, "loss/heads.py", "LOSS_HEADS: dict[str, type] = {",
                               '    "announced": type("AnnouncedHead", (FullLogitsHead,), {"describe": lambda self: '
                               '"announced head", "sums": lambda self, *a, **k: print("announced head called") '
                               'or FullLogitsHead.sums(self, *a, **k)}),\n')
    assert len(changed) == 1
    out = _run_in_copy(tmp_path, """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from ntl_pretrain.config import LossConfig
        from ntl_pretrain.loss.heads import FullLogitsHead
        from ntl_pretrain.loss.shard import VocabShard
        from ntl_pretrain.numbers import NumberVocab
        from ntl_pretrain.trainer.training_objective import Objective
        objective = Objective.from_config(LossConfig())
        print(objective.describe())
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2))
        ids = torch.randint(0, 48, (1, 8))
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        vocab = NumberVocab(tuple(range(20, 30)), tuple(float(v) for v in range(10)), 48)
        call = dict(shard=VocabShard(), with_ntl=True, check_inputs=True, spans=None)
        new = objective.head.sums(model, {"input_ids": ids}, labels, vocab, objective.settings, **call)
        full = FullLogitsHead().sums(model, {"input_ids": ids}, labels, vocab, objective.settings, **call)
        assert torch.equal(new.stack(), full.stack())
        """)
    assert out.splitlines()[0].endswith(", announced head") and out.splitlines()[1] == "announced head called"


def _copy_project(tmp_path: Path) -> None:
    """The package, its tests, configs, docs, launcher and tools, and pyproject.toml (pytest's settings) under
    `tmp_path`."""
    for folder in ("ntl_pretrain", "tests", "configs", "docs", "launch", "tools"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")


def _edit(path: Path, anchor: str, text: str, before: bool = False) -> list[str]:
    """Put `text` after (or before) the one line `anchor` of `path` (a new file when `anchor` is empty); the changed
    lines."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if anchor:
        assert old.count(anchor + "\n") == 1, anchor
        new = old.replace(anchor + "\n", text + anchor + "\n" if before else anchor + "\n" + text)
    else:
        new = old + text
    path.write_text(new, encoding="utf-8")
    changed = difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
    return [line for line in changed if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def _pytest_in_copy(tmp_path: Path, *args: str) -> str:
    """pytest in the copy (its package first on the path); its output, after checking that everything passed."""
    environment = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout


LOG_COSH_VARIANT = '''"""`log_cosh`: log(cosh(e)) of the error e between the expected number `sum_k q_k v_k` and the true one."""

from __future__ import annotations

import torch

from .base import NTLVariant, TermInputs, register


class LogCosh(NTLVariant):
    name = "log_cosh"

    def check(self, settings) -> None:
        if settings.reweigh:
            raise ValueError("reweigh does not apply to variant 'log_cosh'; set reweigh=False")

    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        positions = inputs.slot >= 0
        values = inputs.values
        probs = torch.softmax(torch.where(positions[:, None], inputs.number_logits, 0.0), dim=-1)
        return torch.log(torch.cosh(probs @ values - values[inputs.slot.clamp_min(0)])), positions


register(LogCosh())
'''
LOG_COSH_REFERENCE = '''def _plain_log_cosh(logits, labels, tokenizer, settings):
    ids = torch.tensor(digit_ids(tokenizer))
    digit_of = torch.full((logits.shape[-1],), -1)
    digit_of[ids] = torch.arange(10)
    at = (labels >= 0) & (digit_of[labels.clamp_min(0)] >= 0)
    q = torch.softmax(logits[at][:, ids], dim=-1)
    error = q @ torch.arange(10, dtype=q.dtype) - digit_of[labels[at]].to(q.dtype)
    return torch.log(torch.cosh(error)).mean()


'''
# the tests that take their variants from the registry, each run for the new variant alone (-k log_cosh), and the
# ones that listed the variants by hand before (issue 48)
REGISTRY_TESTS = ("tests/test_loss_variants.py", "tests/test_loss.py", "tests/test_loss_heads.py",
                  "tests/test_loss_del.py")


def test_a_new_variant_is_one_module_and_its_reference(tmp_path):
    """A variant without options (log-cosh of the expected number's error): its module in loss/variants/ and its
    plain-torch reference in tests/helpers/variants.py. The config takes it, --help names it, and the checks every
    variant gets run for it and pass: against its reference on one process and through the chunked head, with the
    tests that named every variant by hand before, untouched."""
    _copy_project(tmp_path)
    module = _edit(tmp_path / "ntl_pretrain" / "loss" / "variants" / "log_cosh.py", "", LOG_COSH_VARIANT)
    helpers = tmp_path / "tests" / "helpers" / "variants.py"
    reference = _edit(helpers, "# variant name -> its reference: (logits [B, S, V], labels [B, S], the tokenizer, "
                      "NTLSettings) -> the mean NTL term", LOG_COSH_REFERENCE, before=True)
    reference += _edit(helpers, '    "digit_entropy": _plain_digit_entropy,', '    "log_cosh": _plain_log_cosh,\n')
    assert (len(module), len(reference)) == (24, 11)
    out = _run_in_copy(tmp_path, f"""
        from ntl_pretrain.config import load_config
        from ntl_pretrain.config.parsing import help_text
        from ntl_pretrain.loss import VARIANTS
        cfg = load_config({str(REPO / "configs" / "demo.yaml")!r}, ["loss.variant=log_cosh"])
        print(VARIANTS[-1], cfg.loss.variant, "log_cosh" in help_text())
        """)
    assert out.split() == ["log_cosh", "log_cosh", "True"]
    out = _pytest_in_copy(tmp_path, "-m", "fast and not multiprocess", "-k", "log_cosh", *REGISTRY_TESTS)
    # 4 in test_loss_variants, 2 in test_loss, 1 each in the others
    assert out.splitlines()[-1].startswith("8 passed,"), out[-2000:]
    _pytest_in_copy(tmp_path, "-m", "fast", "tests/test_config.py::test_dry_run_refuses_a_bad_choice_naming_the_allowed_"
                    "values", "tests/test_loss_digit_entropy.py::test_it_is_registered_and_named_by_the_config")


REPEAT_BENCHMARK = '''"""`repeat`: continue fixed prompts; its figure is the mean length of the continuations."""

from __future__ import annotations

from dataclasses import dataclass

from ntl_pretrain.eval.benchmarks.base import Benchmark, BenchmarkResult, check_at_least, setting

PROMPTS = ("12+3=", "a", "7-8=", "the answer is")


@dataclass
class RepeatSettings:
    repeat_n: int = setting("prompts of the repeat benchmark (0: skip it)", default=0)
    repeat_max_new_tokens: int = setting("tokens generated at most per prompt", default=6)

    def __post_init__(self) -> None:
        check_at_least(self, 0, "repeat_n")


class Repeat(Benchmark):
    name = "repeat"
    Settings = RepeatSettings
    max_new_tokens_key = "repeat_max_new_tokens"

    def enabled(self, settings):
        return settings.repeat_n > 0

    def run(self, model, tokenizer, settings, context):
        prompts = PROMPTS[:settings.repeat_n]
        generation = context.generate(model, tokenizer, prompts, label=self.name, what=f"{len(prompts)} prompts",
                                      max_new_tokens=settings.repeat_max_new_tokens, stop=("\\\\n",),
                                      add_special_tokens=context.add_special_tokens)
        records = [{"benchmark": self.name, "prompt": p, "output": o, "extracted": len(o), "gold": None,
                    "correct": None} for p, o in zip(prompts, generation.texts)]
        mean = sum(len(text) for text in generation.texts) / len(prompts)
        return BenchmarkResult({"eval/repeat/mean_chars": mean}, records, generation)


REPEAT = Repeat()
'''


def test_a_new_benchmark_is_one_module_and_its_registry_line(tmp_path):
    """docs/evaluation.md's benchmark (settings, checks, run) as a module of eval/benchmarks/ and its registry line
    (plus its import): the run config and --help take its keys, its check refuses a bad value in one line naming
    the key, the evaluation runs it beside the built-in ones on a tiny model (TensorBoard figure, predictions
    file), and the tests that read the benchmark registry pass in the copy."""
    _copy_project(tmp_path)
    benchmarks = tmp_path / "ntl_pretrain" / "eval" / "benchmarks"
    module = _edit(benchmarks / "repeat.py", "", REPEAT_BENCHMARK)
    registry = _edit(benchmarks / "__init__.py", "from ntl_pretrain.eval.benchmarks.gsm8k import GSM8K",
                     "from ntl_pretrain.eval.benchmarks.repeat import REPEAT\n")
    registry += _edit(benchmarks / "__init__.py", "    GSM8K,", "    REPEAT,\n")
    assert (len(module), len(registry)) == (40, 2)
    out = _run_in_copy(tmp_path, f"""
        import json
        import sys
        sys.path.insert(0, {str(tmp_path / "tests")!r})
        from helpers.models import char_tokenizer, eval_llama
        from ntl_pretrain.config import load_config
        from ntl_pretrain.config.parsing import help_text
        from ntl_pretrain.eval.hooks import predictions_path, run_evaluation
        demo = {str(REPO / "configs" / "demo.yaml")!r}
        cfg = load_config(demo, ["eval.repeat_n=3", "eval.arithmetic_n=1"])
        print(cfg.eval.repeat_n, "eval.repeat_n" in help_text(), "eval.repeat_max_new_tokens" in help_text())
        try:
            load_config(demo, ["eval.repeat_n=-1"])
        except ValueError as error:
            print(error)
        tokenizer = char_tokenizer()
        metrics = run_evaluation(eval_llama(len(tokenizer), seed=4), tokenizer, cfg.eval, step=1, output_dir="out")
        lines = [json.loads(line) for line in open(predictions_path("out", 1), encoding="utf-8")]
        print(sorted({{line["benchmark"] for line in lines}}), "eval/repeat/mean_chars" in metrics)
        """)
    assert out.splitlines()[:2] == ["3 True True", "eval.repeat_n=-1 must be >= 0"], out
    assert out.splitlines()[2] == "['arith', 'repeat'] True", out
    _pytest_in_copy(tmp_path, "-m", "fast", "tests/test_eval_registry.py", "tests/test_config.py", "-k",
                    "registry or help or eval")


def test_a_new_model_family_is_one_entry_its_tiny_model_and_its_docs_row(tmp_path):
    """OLMo (1) as one `FAMILIES` entry, its tiny model in tests/test_model_families.py and its row in
    docs/training.md's table (a test keeps the page equal to the registry): the start-up check takes it, and the
    family tests that read the table pass in the copy (its tiny model builds; the page is the table)."""
    _copy_project(tmp_path)
    entry = _edit(tmp_path / "ntl_pretrain" / "models" / "families.py", '    "falcon": Family("Falcon", special="fused '
                  'query_key_value, parallel attention/MLP"),', '    "olmo": Family("OLMo", special="non-parametric '
                  'layer norms"),\n')
    tiny = _edit(tmp_path / "tests" / "test_model_families.py", "                   num_hidden_layers=2, "
                 "num_attention_heads=8, max_position_embeddings=64),", '    "olmo": dict(tie_word_embeddings=False, '
                 '**COMMON),\n')
    docs = _edit(tmp_path / "docs" / "training.md", "| Falcon (`falcon`) | trains | trains | T=1 and T>1 | fused "
                 "query_key_value, parallel attention/MLP |", "| OLMo (`olmo`) | trains | trains | T=1 and T>1 | "
                 "non-parametric layer norms |\n")
    assert (len(entry), len(tiny), len(docs)) == (1, 1, 1)
    out = _run_in_copy(tmp_path, """
        from transformers import AutoConfig
        from ntl_pretrain.models.families import check_family, families_table
        check_family(AutoConfig.for_model("olmo"), tp_size=2, partitioned_load=True)
        print(families_table().splitlines()[-1])
        """)
    assert out.strip() == "| OLMo (`olmo`) | trains | trains | T=1 and T>1 | non-parametric layer norms |", out
    _pytest_in_copy(tmp_path, "tests/test_model_families.py", "-k", "tiny_model or docs_table")


POWER_VARIANT = '''"""`power`: |expected number - true number| ** power_exponent at every number token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.options import check_number, option
from .base import NTLVariant, TermInputs, register


@dataclass(frozen=True)
class Options:
    """The options of "power"."""

    power_exponent: float = option("the exponent p of |expected - true| ** p", default=1.5)

    def __post_init__(self) -> None:
        check_number(self.power_exponent, "power_exponent", "0 would make every term 1", low_allowed=False)


class Power(NTLVariant):
    name = "power"
    Options = Options

    def max_loss(self, number_vocab, settings, device, dtype) -> torch.Tensor:
        values = number_vocab.values_tensor(device, dtype)
        return (values.max() - values.min()) ** settings.power_exponent

    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        positions = inputs.slot >= 0
        values = inputs.values
        probs = torch.softmax(torch.where(positions[:, None], inputs.number_logits, 0.0), dim=-1)
        error = (probs @ values - values[inputs.slot.clamp_min(0)]).abs()
        return error ** inputs.settings.power_exponent, positions


register(Power())
'''


def test_a_new_variant_with_an_option_is_one_module(tmp_path):
    """A variant `power` with its own option `power_exponent`, as one new module in loss/variants/ (no other file
    changed): the config takes loss.power_exponent (and writes it), --help shows it with its doc, validation refuses
    a bad value and the option with another variant (one line naming loss.power_exponent), and number_token_loss
    takes it as a keyword and equals a plain-torch reference."""
    _copy_package(tmp_path)
    (tmp_path / "ntl_pretrain" / "loss" / "variants" / "power.py").write_text(POWER_VARIANT, encoding="utf-8")
    out = _run_in_copy(tmp_path, f"""
        import contextlib, inspect, io
        import torch
        from ntl_pretrain.cli import parse_args
        from ntl_pretrain.config import ConfigError, load_config, ntl_settings, to_yaml
        from ntl_pretrain.loss import NTLSettings, number_token_loss
        from ntl_pretrain.numbers import NumberVocab
        demo = {str(REPO / "configs" / "demo.yaml")!r}
        cfg = load_config(demo, ["parallel.tp_size=1", "loss.variant=power", "loss.power_exponent=3"])
        assert ntl_settings(cfg.loss) == NTLSettings(variant="power", power_exponent=3.0)
        assert "  power_exponent: 3" in to_yaml(cfg)
        print(ntl_settings(cfg.loss).describe())
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
            parse_args(["--help"])
        assert "loss.power_exponent (float, default 1.5)\\n      power: the exponent p of |expected - true| ** p" \\
            in shown.getvalue(), shown.getvalue()
        for overrides in (["loss.variant=power", "loss.power_exponent=0"], ["loss.power_exponent=3"]):
            try:
                load_config(demo, ["parallel.tp_size=1", *overrides])
            except ConfigError as error:
                print(error)
        assert "power_exponent" in inspect.signature(number_token_loss).parameters
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 6, 20, generator=generator, dtype=torch.float64)
        labels = torch.tensor([[3, 4, 1, 5, 12, -100], [7, 0, 8, 9, 2, 3]])
        vocab = NumberVocab(tuple(range(3, 13)), tuple(float(v) for v in range(10)), 20)
        loss = number_token_loss(logits, labels, vocab, variant="power", power_exponent=3.0)
        is_number = (labels >= 3) & (labels <= 12)
        values = torch.arange(10, dtype=torch.float64)
        expected = torch.softmax(logits[..., 3:13], dim=-1) @ values
        reference = ((expected - (labels - 3).to(torch.float64)).abs() ** 3)[is_number].mean()
        torch.testing.assert_close(loss, reference)
        """)
    lines = out.splitlines()
    assert lines[0] == "variant=power, reweigh=False, power_exponent=3.0"
    assert lines[1] == "loss.power_exponent must be > 0 and finite (0 would make every term 1), got 0.0"
    assert lines[2].startswith("loss.power_exponent applies to variant 'power' only, not 'was'")
