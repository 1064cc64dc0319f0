"""docs/architecture.md's recipes, each made in a temporary copy of the package and checked there in a fresh
process: a new learning-rate schedule and a new loss head are each one table entry (the diff is counted)."""

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


def _copy_with_entry(tmp_path: Path, module: str, anchor: str, entry: str) -> list[str]:
    """Copy ntl_pretrain/ to `tmp_path`, add `entry` to `module` after the line `anchor`; the changed lines."""
    shutil.copytree(REPO / "ntl_pretrain", tmp_path / "ntl_pretrain", ignore=shutil.ignore_patterns("__pycache__"))
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
