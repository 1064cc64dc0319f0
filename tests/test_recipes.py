"""docs/architecture.md's recipes, each made in a temporary copy of the package and checked there in a fresh
process: a new learning-rate schedule and a new loss head are each one table entry (the diff is counted), a new NTL
variant with an option of its own is one new module."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast
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
