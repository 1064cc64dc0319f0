"""The run configuration: YAML + overrides, strict keys and types, --help, DeepSpeed JSON merge, dry runs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ntl_pretrain.config import Config, ConfigError, help_text, iter_keys, load_config, to_dict, write_resolved
from ntl_pretrain.trainer.ds_config import deepspeed_config, generated_deepspeed_config, resolve_run
from ntl_pretrain.cli import main, parse_args
from ntl_pretrain.loss import VARIANTS
from ntl_pretrain.trainer.training_objective import Objective

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.fast
MINIMAL = ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok", "data.sources.0.path=corpus.jsonl"]


def test_yaml_and_overrides_reach_typed_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"architecture": {"model_type": "llama", "hidden_size": 64}},
                                    "tokenizer": {"name_or_path": "tok"},
                                    "data": {"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": 2}]},
                                    "optim": {"betas": [0.9, 0.99]}}))
    cfg = load_config(path, ["train.max_steps=7", "optim.lr=1e-4", "data.sources.1.weight=3",
                             "model.architecture.hidden_size=32", "loss.squash_factor=null", "data.seq_len=64"])
    assert cfg.train.max_steps == 7 and isinstance(cfg.train.max_steps, int)
    assert cfg.optim.lr == pytest.approx(1e-4)  # "1e-4" is a YAML string; a float field converts it
    assert [s.weight for s in cfg.data.sources] == [1.0, 3.0]
    assert cfg.model.architecture == {"model_type": "llama", "hidden_size": 32}
    assert cfg.optim.betas == [0.9, 0.99] and cfg.data.seq_len == 64


@pytest.mark.parametrize("override, nearest", [
    ("train.max_stepz=3", "train.max_steps"),
    ("loss.ntl_wieght=0.1", "loss.ntl_weight"),
    ("data.sources.0.text_feild=body", "data.sources.0.text_field"),
    ("paralel.tp_size=2", "parallel.tp_size"),
])
def test_unknown_key_names_the_nearest_valid_key(override, nearest):
    with pytest.raises(ConfigError, match="unknown config key") as info:
        load_config(None, MINIMAL + [override])
    assert repr(nearest) in str(info.value)


def test_unknown_key_in_yaml_is_rejected(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match=r"'train.max_step'.*did you mean 'train.max_steps'"):
        load_config(path, MINIMAL)


@pytest.mark.parametrize("override, message", [
    ("train.max_steps=ten", "train.max_steps must be an integer, got str 'ten'"),
    ("train.max_steps=1.5", "train.max_steps must be an integer"),
    ("model.gradient_checkpointing=yes please", "model.gradient_checkpointing must be true or false"),
    ("optim.lr=fast", "optim.lr must be a number"),
    ("data.sources=corpus.jsonl", "data.sources must be a list"),
    ("train.output_dir=3", "train.output_dir must be a string"),
])
def test_wrong_type_is_named(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, MINIMAL + [override])
    assert message in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("parallel.zero_stage=4", "parallel.zero_stage"),
    ("model.dtype=fp8", "model.dtype='fp8' is not one of bf16, fp16, fp32"),
    ("loss.variant=l2", "loss.variant"),
    ("data.seq_len=0", "data.seq_len must be >= 1"),
    ("loss.ntl_schedule=linear_warmup", "loss.ntl_warmup_steps"),
    ("data.sources.0.weight=0", "data.sources.0.weight must be > 0"),
])
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, MINIMAL + [override])
    assert message in str(info.value)


def test_help_lists_every_key_with_default_and_meaning():
    result = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.sh"), "--help"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    keys = [key for key, *_ in iter_keys()]
    assert len(keys) > 50
    for key, _, _default, doc in iter_keys():
        assert f"  {key} (" in result.stdout, key
        assert doc and doc.split("\n")[0][:40] in result.stdout.replace("\n      ", " "), key


def test_help_through_bash(tmp_path):
    result = subprocess.run(["bash", str(REPO / "launch" / "pretrain.sh"), "--help"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "loss.ntl_weight" in result.stdout and "parallel.tp_size" in result.stdout


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, MINIMAL + ["train.max_steps=9", "loss.variant=mse"])
    path = write_resolved(cfg, str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run") == ["config.yaml"]  # no temporary left behind
    again = load_config(path)
    assert to_dict(again) == to_dict(cfg)


def test_local_rank_and_intermixed_overrides_parse():
    args = parse_args(["--local_rank=1", "--config", "x.yaml", "a.b=1", "--dry-run", "c.d=2"])
    assert args.config == "x.yaml" and args.dry_run and args.overrides == ["a.b=1", "c.d=2"]


def test_generated_deepspeed_config_uses_deepspeed_keys():
    cfg = load_config(None, MINIMAL + ["parallel.tp_size=2", "parallel.zero_stage=3", "data.micro_batch_size=4",
                                       "train.grad_accum_steps=2", "model.dtype=bf16", "optim.grad_clip=0.5"])
    ds = deepspeed_config(cfg, on_cpu=True)
    assert ds["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": True}
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": True}
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 0.5 and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["scheduler"]["type"] == "WarmupCosineLR"


def test_user_deepspeed_json_is_merged_and_read_back(tmp_path):
    user = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 1000},
            "tensor_parallel": {"autotp_size": 4}, "gradient_clipping": "auto", "bf16": {"enabled": False},
            "fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": 3}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    cfg = load_config(None, MINIMAL + [f"deepspeed.config={path}", "optim.grad_clip=0.7", "parallel.tp_size=2"])
    before = to_dict(cfg)
    run = resolve_run(cfg, on_cpu=False, world_size=8)
    ds = run.ds_config
    assert ds == deepspeed_config(cfg, on_cpu=False, world_size=8)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert ds["gradient_clipping"] == 0.7  # "auto" keeps the YAML's value
    assert ds["tensor_parallel"]["autotp_size"] == 4 and ds["tensor_parallel"]["vocab_parallel_lm_head"] is True
    # the resolved config says what DeepSpeed will do; the loaded one is left as it was (resolved once, a copy)
    resolved = run.cfg
    assert (resolved.parallel.tp_size, resolved.parallel.zero_stage, resolved.model.dtype,
            resolved.data.micro_batch_size, resolved.optim.grad_clip) == (4, 2, "fp16", 3, 0.7)
    assert to_dict(cfg) == before


def test_missing_or_broken_deepspeed_json(tmp_path):
    cfg = load_config(None, MINIMAL + [f"deepspeed.config={tmp_path / 'nope.json'}"])
    with pytest.raises(ConfigError, match="nope.json' does not exist"):
        deepspeed_config(cfg, on_cpu=True)
    (tmp_path / "bad.json").write_text("{stage: 3")
    cfg = load_config(None, MINIMAL + [f"deepspeed.config={tmp_path / 'bad.json'}"])
    with pytest.raises(ConfigError, match="not valid JSON"):
        deepspeed_config(cfg, on_cpu=True)


@pytest.mark.parametrize("config, world", [(p.name, w) for p, w in
                                           [(REPO / "configs" / "demo.yaml", 2)] +
                                           [(p, 16) for p in sorted((REPO / "configs").glob("*.yaml"))
                                            if p.name != "demo.yaml"]])
def test_every_shipped_config_passes_a_dry_run(config, world, dry_run_here):
    result = dry_run_here("--config", f"configs/{config}", "--world-size", str(world))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run OK" in result.stdout


def test_dry_run_rejects_tp_size_that_does_not_divide_the_world(dry_run_here):
    result = dry_run_here("--config", "configs/demo.yaml", "--world-size", "3", "parallel.tp_size=2")
    assert result.returncode == 2
    assert "parallel.tp_size=2 does not divide the world size 3" in result.stderr
    assert "set parallel.tp_size=1" in result.stderr
    auto = dry_run_here("--config", "configs/demo.yaml", "--world-size", "3")  # the demo's tp_size: auto
    assert auto.returncode == 0 and "using tp_size=1 for world size 3" in auto.stdout, auto.stderr[-2000:]


def test_every_key_has_a_doc_and_a_default():
    for key, _hint, _default, doc in iter_keys():
        assert doc, f"{key} has no one-line doc"
    assert dataclasses.asdict(Config())  # every section builds from defaults


def _objective(*overrides: str) -> Objective:
    return Objective.from_config(load_config(None, MINIMAL + list(overrides)).loss)


def test_ntl_weight_schedules():
    constant = _objective("loss.ntl_weight=0.5")
    assert constant.ntl_on and [constant.ntl_lambda(s) for s in (1, 10, 1000)] == [0.5, 0.5, 0.5]
    warm = _objective("loss.ntl_weight=0.4", "loss.ntl_schedule=linear_warmup", "loss.ntl_warmup_steps=4")
    assert [warm.ntl_lambda(s) for s in (1, 2, 4, 9)] == pytest.approx([0.1, 0.2, 0.4, 0.4])
    for off in (_objective("loss.enabled=false"), _objective("loss.ntl_weight=0")):  # one switch, two ways to say off
        assert not off.ntl_on and off.ntl_lambda(5) == 0.0


def test_objective_decides_ntl_and_the_head_once():
    full = _objective("loss.chunk_tokens=0")
    chunked = _objective("loss.chunk_tokens=256", "loss.variant=mse")
    assert (full.chunk_tokens, chunked.chunk_tokens, chunked.settings.variant) == (0, 256, "mse")
    assert "full logits" in full.describe() and "chunked LM head (256 tokens" in chunked.describe()
    # number_level needs digit tokens only where NTL is on: with ntl_weight=0 the run is CE only and starts
    with pytest.raises(ConfigError, match="number_level composes numbers"):
        load_config(None, MINIMAL + ["loss.variant=number_level", "tokenizer.digit_level=false"])
    assert not _objective("loss.variant=number_level", "tokenizer.digit_level=false", "loss.ntl_weight=0").ntl_on


def test_choices_live_in_their_types():
    import typing

    from ntl_pretrain.config import LossConfig
    from ntl_pretrain.eval.config import GSM8K_VARIANTS
    from ntl_pretrain.eval.gsm8k import DEFAULT_NUM_FEWSHOT
    from ntl_pretrain.loss import VARIANTS
    from ntl_pretrain.loss.chunked import CHUNK_BACKWARDS

    # the loss's own list of variants and the harness defaults per GSM8K variant agree with the config's types
    assert typing.get_args(typing.get_type_hints(LossConfig)["variant"]) == VARIANTS
    assert typing.get_args(typing.get_type_hints(LossConfig)["chunk_backward"]) == CHUNK_BACKWARDS
    assert tuple(DEFAULT_NUM_FEWSHOT) == GSM8K_VARIANTS
    assert "parallel.zero_stage (0 | 1 | 2 | 3, default 3)" in help_text()


@pytest.mark.parametrize("override, allowed", [
    ("loss.variant=wass", f"loss.variant='wass' is not one of {', '.join(VARIANTS)}"),
    ("parallel.zero_stage=4", "parallel.zero_stage=4 is not one of 0, 1, 2, 3"),
    ("eval.gsm8k_variant=gsm8k_cott", "eval.gsm8k_variant='gsm8k_cott' is not one of gsm8k, gsm8k_cot"),
    ("parallel.tp_size=most", "parallel.tp_size must be an integer or one of auto, got str 'most'"),
])
def test_dry_run_refuses_a_bad_choice_naming_the_allowed_values(override, allowed, capsys):
    assert main(["--dry-run", "--config", str(REPO / "configs" / "demo.yaml"), "--world-size", "2", override]) == 2
    assert f"error: {allowed}\n" in capsys.readouterr().err


def test_dry_run_checks_eval_budgets_against_a_pretrained_models_positions(tmp_path, capsys):
    # a model folder (config.json only: the dry run loads no weights) with 64 positions
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(tmp_path / "model")
    args = ["--dry-run", "--config", str(REPO / "configs" / "demo.yaml"), "--world-size", "2",
            f"model.name_or_path={tmp_path / 'model'}", "model.architecture={}", "data.seq_len=64"]
    assert main(args) == 0 and "dry run OK" in capsys.readouterr().out
    # before, the budget was checked against model.architecture's max_position_embeddings only (none here)
    assert main(args + ["eval.arithmetic_max_new_tokens=64"]) == 2
    assert ("eval.arithmetic_max_new_tokens=64 leaves no room for the prompt within 64 tokens (the model's "
            "max_position_embeddings)") in capsys.readouterr().err


def test_preflight_resolves_a_copy_once():
    from ntl_pretrain.trainer.preflight import preflight

    cfg = load_config(REPO / "configs" / "demo.yaml")
    before = to_dict(cfg)
    checked = preflight(cfg, world_size=4, on_cpu=True, local_files_only=True)
    assert to_dict(cfg) == before and cfg.parallel.tp_size == "auto"  # what was loaded stays as it was
    resolved = checked.run.cfg
    assert resolved.parallel.tp_size == 2 and checked.run.ds_config["tensor_parallel"]["autotp_size"] == 2
    assert "tp_size=2 for world size 4" in checked.run.tp_note
    assert checked.objective == Objective.from_config(resolved.loss) and checked.objective.ntl_on
    assert checked.model_config.max_position_embeddings == resolved.model.architecture["max_position_embeddings"]


@pytest.mark.parametrize("text, key", [
    ("train:\n  output_dir: runs/mine\noptim:\n  lr: 1.0e-3\ntrain:\n  max_steps: 3\n", "train"),
    ("optim:\n  lr: 1.0e-3\n  warmup_steps: 5\n  lr: 2.0e-3\n", "lr"),
    ("model:\n  architecture:\n    model_type: llama\n    hidden_size: 64\n    hidden_size: 32\n", "hidden_size"),
    ("data:\n  sources:\n    - path: a.jsonl\n      generate_options: {seed: 1, text_share: 0.5}\n"
     "      generate_options: {seed: 2}\n", "generate_options"),
    ("data:\n  sources:\n    - path: a.jsonl\n      generate_arithmetic: 10\n      generate_options:\n"
     "        seed: 1\n        seed: 2\n", "seed"),
])
def test_a_yaml_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, key):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    lines = [number for number, line in enumerate(text.splitlines(), start=1) if line.strip().startswith(f"{key}:")]
    assert len(lines) == 2 and yaml.safe_load(text) is not None  # PyYAML alone keeps the last silently
    with pytest.raises(ConfigError) as info:
        load_config(path, MINIMAL)
    message = str(info.value)
    assert f"key {key!r} is given twice (lines {lines[0]} and {lines[1]})" in message, message
    assert str(path) in message and "\n" not in message


def test_duplicates_in_flow_mappings_are_refused_and_on_the_command_line_the_last_wins_said(tmp_path, caplog):
    value = "{hidden_size: 8, hidden_size: 16}"
    columns = value.index("hidden_size") + 1, value.rindex("hidden_size") + 1
    with pytest.raises(ConfigError, match=rf"key 'hidden_size' is given twice \(line 1, columns {columns[0]} and "
                                          rf"{columns[1]}\)"):
        load_config(None, MINIMAL + [f"model.architecture={value}"])
    # a wrapper's defaults come first (launch/slurm_pretrain.sbatch: train.resume=auto "$@"), so the last wins
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        assert load_config(None, MINIMAL + ["optim.lr=1e-3", "train.max_steps=3", "optim.lr=2e-3"]).optim.lr == 2e-3
    assert "override optim.lr is given twice on the command line ('optim.lr=1e-3', then 'optim.lr=2e-3')" in caplog.text
    # a YAML merge key is no duplicate: the explicit key beside it overrides the merged one, as YAML means
    path = tmp_path / "merge.yaml"
    path.write_text("optim: &base {lr: 1.0e-3, warmup_steps: 5}\ntrain:\n  max_steps: 3\n"
                    "checkpoint:\n  every_n_steps: 2\n")
    assert load_config(path, MINIMAL).optim.lr == 1e-3
    path.write_text("model:\n  architecture:\n    common: &c {hidden_size: 64, num_hidden_layers: 2}\n"
                    "    model_type: llama\n    <<: *c\n    hidden_size: 32\n")
    architecture = load_config(path, MINIMAL[1:]).model.architecture
    assert architecture["hidden_size"] == 32 and architecture["num_hidden_layers"] == 2


def _laughs(levels: int) -> str:
    """A billion-laughs document: each anchor a list of nine aliases of the previous one (9**levels leaves)."""
    rows = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    rows += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join("    " + row for row in rows)


def test_alias_bombs_and_recursive_aliases_are_refused_at_once(tmp_path):
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(f"model:\n  architecture:\n    model_type: llama\n{_laughs(9)}\n")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_config(path, MINIMAL[1:])
    assert time.perf_counter() - start < 5
    assert f"file {str(path)!r}: holds more than 100000 values counting what its aliases (*name) expand to" \
        in str(info.value)
    path.write_text("model:\n  architecture: &self\n    model_type: llama\n    inner: *self\n")
    with pytest.raises(ConfigError, match=r"line 2 holds an alias inside its own anchor"):
        load_config(path, MINIMAL[1:])
    with pytest.raises(ConfigError, match=r"holds more than 100000 values counting what its aliases \(\*name\) expand to"):
        load_config(None, MINIMAL + ["model.architecture.x=[&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], &b [*a, *a, *a, *a, *a, "
                                     "*a, *a, *a, *a, *a], &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], "
                                     "&d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]]"])
    path.write_text(f"model:\n  architecture:\n    model_type: llama\n{_laughs(4)}\n")  # 9**4 leaves: a big config, loads
    assert len(load_config(path, MINIMAL[1:]).model.architecture["l3"]) == 9


def test_deepspeed_json_is_checked_with_deepspeeds_own_config_classes(tmp_path):
    """What deepspeed.initialize would refuse after the model is built is refused while resolving the run."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cases = [({"zero_optimization": {"stage": 7}}, "DeepSpeed refuses zero_optimization.stage=7"),
             ({"zero_optimization": {"stage3_gather_16bit_weights_on_modl_save": True}},
              "DeepSpeed refuses zero_optimization.stage3_gather_16bit_weights_on_modl_save=True: not a key"),
             ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
              "DeepSpeed refuses zero_optimization.offload_optimizer.device='gpu'"),
             ({"bf16": {"enabled": "maybe"}}, "DeepSpeed refuses bf16.enabled='maybe'")]
    for user, message in cases:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(user))
        cfg = load_config(None, MINIMAL + [f"deepspeed.config={path}"])
        generated = generated_deepspeed_config(cfg, on_cpu=True)
        ((section, keys),) = user.items()
        with pytest.raises(ValueError):  # the reference: DeepSpeed's own config refuses the merged dict
            DeepSpeedConfig({**generated, section: {**generated[section], **keys}})
        with pytest.raises(ConfigError) as info:
            resolve_run(cfg, on_cpu=True, world_size=2)
        assert f"deepspeed.config={str(path)!r}: {message}" in str(info.value) and "\n" not in str(info.value)
    path.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    cfg = load_config(None, MINIMAL + [f"deepspeed.config={path}"])
    with pytest.raises(ConfigError, match="key 'stage' is given twice in one object"):
        resolve_run(cfg, on_cpu=True, world_size=2)


@pytest.mark.parametrize("every,validated", [
    (0, []), (-1, []),  # off: 0 as -1 (0 used to mean "only after the last step")
    (3, [3, 6, 9, 10]),  # every 3 steps and after the last
    (10, [10]), (25, [10]),  # train.max_steps or more: only after the last
])
def test_val_every_n_steps_0_turns_validation_off(every, validated):
    held_out = "data.validation_documents=0" if every <= 0 else "data.validation_documents=5"
    cfg = load_config(None, MINIMAL + ["train.max_steps=10", f"train.val_every_n_steps={every}", held_out])
    assert cfg.train.validation_on == bool(validated)
    assert [step for step in range(1, 11) if cfg.train.validates_after(step)] == validated
    if every > 0:
        with pytest.raises(ConfigError, match=rf"validation is on \(train.val_every_n_steps={every}\) but "
                                              r"data.validation_documents=0; .* train.val_every_n_steps=0 \(off\)"):
            load_config(None, MINIMAL + [f"train.val_every_n_steps={every}", "data.validation_documents=0"])
