"""Bad input refused early with one clear line naming the key or file and the fix (issues 12 and 13):
non-finite and out-of-range floats, loss settings the loss would refuse after the build, misspelt
architecture keys, data.seq_len beyond the model's positions, a missing local model folder, a DeepSpeed
JSON whose batch sizes disagree, empty / latin-1 / all-whitespace corpora, a read-only output folder on
two ranks; and files written with the permissions the umask gives."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.distributed import free_port, rank_env  # noqa: E402
from ntl_pretrain.config import ConfigError, DataSourceConfig, load_config
from ntl_pretrain.data import DataError, PretrainingData

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")
MINIMAL = ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok", "data.sources.0.path=corpus.jsonl"]


# ---------------------------------------------------------------------------------------------- config load
@pytest.mark.parametrize("override, message", [
    ("loss.ntl_weight=.nan", "loss.ntl_weight must be a finite number, got nan"),
    ("loss.ntl_weight=nan", "loss.ntl_weight must be a finite number"),  # a YAML string that float() reads
    ("optim.lr=-1", "optim.lr must be > 0, got -1"),
    ("optim.lr=0", "optim.lr must be > 0"),
    ("optim.lr=.inf", "optim.lr must be a finite number, got inf"),
    ("optim.betas=[0.9, 1.5]", "optim.betas.1=1.5 must be in [0, 1)"),
    ("optim.betas=[-0.1, 0.9]", "optim.betas.0=-0.1 must be in [0, 1)"),
    ("optim.betas=[0.9, .nan]", "optim.betas.1 must be a finite number"),
    ("optim.eps=0", "optim.eps must be > 0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio must be >= 0 and <= 1, got 2"),
    ("optim.grad_clip=.nan", "optim.grad_clip must be a finite number"),
    ("optim.grad_clip=-1", "optim.grad_clip must be >= 0"),
    ("loss.smoothing_sigma=.nan", "loss.smoothing_sigma must be a finite number"),
    ("loss.squash_factor=.inf", "loss.squash_factor must be a finite number"),
    ("data.sources.0.weight=.inf", "data.sources.0.weight must be a finite number"),
    ("checkpoint.preempt_grace_s=.nan", "checkpoint.preempt_grace_s must be a finite number"),
    # the loss's own checks, which used to run only after the model and the engine were built
    ("loss.squash_factor=1", "squash_factor must be > 1"),
    ("loss.variant=number_level|loss.smoothing_sigma=0.5", "smoothing_sigma needs variant 'was'"),
    ("loss.variant=mse|loss.squash_factor=3", "squash_factor applies to variant 'was' only"),
    ("loss.float_level=true", "float_level applies to variant 'number_level' only"),
    # what the checkpoint code read only when it loaded or exported a checkpoint (after the build, after the run)
    ("train.resume=../x", "train.resume='../x' is not none, auto or a checkpoint tag inside train.output_dir"),
    ("train.resume=global_step-1", "train.resume='global_step-1' is not none, auto or a checkpoint tag"),
    ("train.resume=/abs/global_step3", "train.resume='/abs/global_step3' is not none, auto or a checkpoint tag"),
    ("train.output_dir=", "train.output_dir is empty"),
    ("checkpoint.export_max_shard_size=abc", "checkpoint.export_max_shard_size='abc' is not a size"),
    ("checkpoint.export_max_shard_size=0MB", "checkpoint.export_max_shard_size='0MB' is not a size"),
    ("checkpoint.export_max_shard_size=nanGB", "checkpoint.export_max_shard_size='nanGB' is not a size"),
    # issue 40, go-beyond round: numpy's `ValueError: expected non-negative integer` once the data was built
    ("data.seed=-1", "data.seed must be a seed in [0, 2**63), got -1"),
    ("train.seed=-1", "train.seed must be a seed in [0, 2**63), got -1"),
    ("model.init_seed=-3", "model.init_seed must be a seed in [0, 2**63), got -3"),
])
def test_bad_values_are_refused_at_load(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, MINIMAL + override.split("|"))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("override, nearest", [
    ("optim.learning_rate=1e-3", "optim.lr"),
    ("train.lr=1e-3", "optim.lr"),  # the right key in another section
    ("data.max_seq_len=64", "data.seq_len"),
    ("train.gradient_accumulation_steps=2", "train.grad_accum_steps"),
    ("optim.max_grad_norm=1", "optim.grad_clip"),
    ("data.sources.0.text_feild=body", "data.sources.0.text_field"),
    ("optim.warmup_step=3", "optim.warmup_steps"),
])
def test_did_you_mean_points_at_the_key_meant(override, nearest):
    with pytest.raises(ConfigError, match="unknown config key") as info:
        load_config(None, MINIMAL + [override])
    assert f"did you mean {nearest!r}?" in str(info.value)


def test_shard_sizes_are_read_as_the_export_reads_them():
    from ntl_pretrain.checkpoint import CheckpointError
    from ntl_pretrain.checkpoint.export import max_shard_bytes

    for size in ("abc", "0MB", "nanGB", "5 GiB", "-5GB", "0"):
        with pytest.raises(CheckpointError):
            max_shard_bytes(size)
        with pytest.raises(ConfigError, match="is not a size"):
            load_config(None, MINIMAL + [f"checkpoint.export_max_shard_size={size}"])
    for size in ("500MB", "5GB", "1.5 GB", "300000"):  # a plain byte count too, as the export reads it
        assert max_shard_bytes(size) > 0
        assert load_config(None, MINIMAL + [f"checkpoint.export_max_shard_size={size}"])


def test_an_export_folder_where_the_export_would_be_refused_is_refused_at_load(tmp_path):
    run = tmp_path / "run"
    for export_dir, why in ((run, "is the run folder"), (run / "global_step4" / "hf", "is inside the checkpoint "
                                                                                      "global_step4")):
        with pytest.raises(ConfigError, match=f"checkpoint.export_dir=.* {why}"):
            load_config(None, MINIMAL + [f"train.output_dir={run}", f"checkpoint.export_dir={export_dir}"])
    for export_dir in (run / "export", tmp_path / "elsewhere"):
        assert load_config(None, MINIMAL + [f"train.output_dir={run}", f"checkpoint.export_dir={export_dir}"])


def test_unreadable_config_files_are_named(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("train:\n  output_dir: runs/caf\u00e9\n".encode("latin-1"))
    with pytest.raises(UnicodeDecodeError):
        latin.read_text(encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(latin, MINIMAL)
    assert f"config file {str(latin)!r} is not UTF-8 text (byte 0xe9 on line 2" in str(info.value)
    (tmp_path / "folder.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"folder.yaml' is a folder, not a file"):
        load_config(tmp_path / "folder.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"config file '/dev/zero' is not a regular file"):  # was: "does not exist"
        load_config("/dev/zero", MINIMAL)
    (tmp_path / "comments.yaml").write_text("# nothing set yet\n")
    with pytest.raises(ConfigError, match=r"comments.yaml' holds no settings"):  # was: a run on the defaults
        load_config(tmp_path / "comments.yaml", MINIMAL)
    (tmp_path / "deep.yaml").write_text("model:\n  architecture:\n    x: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(RecursionError):
        yaml.safe_load((tmp_path / "deep.yaml").read_text())
    with pytest.raises(ConfigError, match=r"deep.yaml': collections nested too deeply"):
        load_config(tmp_path / "deep.yaml", MINIMAL)
    (tmp_path / "bool.yaml").write_text("train:\n  yes: 3\n")  # YAML 1.1 reads `yes` as True
    with pytest.raises(ConfigError, match=r"config key True in \[train\] is not a name"):
        load_config(tmp_path / "bool.yaml", MINIMAL)


def test_deepspeed_json_that_is_no_regular_file_is_refused_not_read_forever(tmp_path):
    from ntl_pretrain.trainer.ds_config import deepspeed_config

    for path, problem in (("/dev/zero", "is not a regular file"), (str(tmp_path), "is a folder")):
        cfg = load_config(None, MINIMAL + [f"deepspeed.config={path}"])
        with pytest.raises(ConfigError, match=f"deepspeed.config={path!r} {problem}"):
            deepspeed_config(cfg, on_cpu=True)


def test_good_values_at_the_edges_still_load():
    cfg = load_config(None, MINIMAL + ["optim.betas=[0, 0.999]", "optim.min_lr_ratio=0", "optim.grad_clip=0",
                                       "loss.ntl_weight=0", "optim.weight_decay=0", "loss.squash_factor=1.5",
                                       "optim.lr=1e-4"])
    assert cfg.optim.betas == [0.0, 0.999] and cfg.loss.squash_factor == 1.5


# ---------------------------------------------------------------------------------------------- model config
def test_misspelt_architecture_key_is_refused_before_the_build(tmp_path):
    from transformers import LlamaConfig

    from ntl_pretrain.models.build import load_model_config

    cfg = load_config(DEMO, ["model.architecture.num_hiden_layers=2"])
    with pytest.raises(ValueError, match=r"model.architecture.num_hiden_layers is not a key of the llama config.*"
                                         r"did you mean 'num_hidden_layers'\?"):
        load_model_config(cfg.model)
    # the same over a saved model's config.json (the keys then override it)
    LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2).save_pretrained(
        tmp_path / "model")
    cfg = load_config(DEMO, [f"model.name_or_path={tmp_path / 'model'}", "model.architecture={num_hiden_layers: 3}"])
    with pytest.raises(ValueError, match="num_hiden_layers is not a key of the llama config"):
        load_model_config(cfg.model)
    # valid keys still apply, including one the constructor converts (rope_theta -> rope_parameters)
    cfg = load_config(DEMO, ["model.architecture.num_hidden_layers=2", "model.architecture.rope_theta=5000.0"])
    config = load_model_config(cfg.model)
    assert config.num_hidden_layers == 2 and config.rope_parameters["rope_theta"] == 5000.0
    assert "num_hiden_layers" not in config.to_dict()


@pytest.mark.parametrize("path", ["./no/such/model", "runs/missing/model"])
def test_missing_local_model_folder_is_not_read_as_a_hub_id(path):
    from ntl_pretrain.models.build import load_model_config

    cfg = load_config(DEMO, [f"model.name_or_path={path}"])
    with pytest.raises(ValueError) as info:
        load_model_config(cfg.model)
    assert f"model.name_or_path={path!r} does not exist" in str(info.value)
    assert "Repo id" not in str(info.value)


def test_seq_len_beyond_the_models_positions_is_refused():
    from ntl_pretrain.models.build import check_sequence_length, load_model_config

    cfg = load_config(DEMO, ["data.seq_len=512"])
    with pytest.raises(ValueError, match=r"data.seq_len=512 is longer than the model's max_position_embeddings=256"):
        check_sequence_length(load_model_config(cfg.model), cfg.data.seq_len)
    check_sequence_length(load_model_config(cfg.model), 256)


# ---------------------------------------------------------------------------------------------- DeepSpeed JSON
def test_deepspeed_train_batch_size_is_resolved_or_refused(tmp_path):
    from ntl_pretrain.trainer.ds_config import deepspeed_config, resolve_run

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64}))
    cfg = load_config(DEMO, [f"deepspeed.config={path}", "parallel.tp_size=1", "data.micro_batch_size=8"])
    run = resolve_run(cfg, on_cpu=True, world_size=2)  # 64 = 8 x accumulation x dp 2
    ds = run.ds_config
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 8, 4)
    assert run.cfg.train.grad_accum_steps == 4  # the resolved config tells the truth
    path.write_text(json.dumps({"train_batch_size": 64, "gradient_accumulation_steps": 2}))
    cfg = load_config(DEMO, [f"deepspeed.config={path}", "parallel.tp_size=1"])
    run = resolve_run(cfg, on_cpu=True, world_size=4)
    assert (run.ds_config["train_micro_batch_size_per_gpu"], run.cfg.data.micro_batch_size) == (8, 8)
    path.write_text(json.dumps({"train_batch_size": 60, "gradient_accumulation_steps": 2,
                                "train_micro_batch_size_per_gpu": 8}))
    cfg = load_config(DEMO, [f"deepspeed.config={path}", "parallel.tp_size=1"])
    with pytest.raises(ConfigError, match=r"train_batch_size=60 must equal .* 8 x 2 x 1 = 16; set train_batch_size to 16"):
        deepspeed_config(cfg, on_cpu=True, world_size=1)
    path.write_text(json.dumps({"train_batch_size": 20}))
    cfg = load_config(DEMO, [f"deepspeed.config={path}", "parallel.tp_size=1"])
    with pytest.raises(ConfigError, match=r"20 is not a multiple of 8 x 2 = 16"):
        deepspeed_config(cfg, on_cpu=True, world_size=2)


# ---------------------------------------------------------------------------------------------- dry run
def _dry_run(dry_run_here, tmp_path: Path, *overrides: str):
    return dry_run_here("--config", DEMO, "--world-size", "2", f"train.output_dir={tmp_path / 'run'}", *overrides,
                        cwd=tmp_path)


@pytest.mark.parametrize("case", ["squash_factor", "number_level_smoothing", "lr", "betas", "architecture_key",
                                  "seq_len", "model_path", "train_batch_size", "zero_stage", "resume",
                                  "document_mask_flash", "moe_expert_width", "flash_attention_missing"])
def test_dry_run_refuses_what_the_trainer_would_refuse(tmp_path, case, dry_run_here, monkeypatch):
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                                                  "gradient_accumulation_steps": 1}))
    (tmp_path / "zero.json").write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    overrides, message = {
        "squash_factor": (["loss.squash_factor=1"], "squash_factor must be > 1"),
        "number_level_smoothing": (["loss.variant=number_level", "loss.smoothing_sigma=0.5"],
                                   "smoothing_sigma needs variant 'was'"),
        "lr": (["optim.lr=-1"], "optim.lr must be > 0"),
        "betas": (["optim.betas=[0.9, 1.5]"], "optim.betas.1=1.5 must be in [0, 1)"),
        "architecture_key": (["model.architecture.num_hiden_layers=2"], "did you mean 'num_hidden_layers'?"),
        "seq_len": (["data.seq_len=512"], "data.seq_len=512 is longer than the model's max_position_embeddings=256"),
        "model_path": (["model.name_or_path=./no/such/model"], "model.name_or_path='./no/such/model' does not exist"),
        "train_batch_size": ([f"deepspeed.config={tmp_path / 'ds.json'}"],
                             "train_batch_size=64 must equal train_micro_batch_size_per_gpu x"),
        "zero_stage": ([f"deepspeed.config={tmp_path / 'zero.json'}"], "DeepSpeed refuses zero_optimization.stage=7"),
        "resume": (["train.resume=../x"], "train.resume='../x' is not none, auto or a checkpoint tag"),
        "document_mask_flash": (["model.attn_implementation=flash_attention_2"],
                                "data.document_mask=true with model.attn_implementation=flash_attention_2 needs "
                                "data.micro_batch_size=1"),
        # issue 47 item 6: passed the dry run, then step 1 died in torch._grouped_mm ("strides should be multiple
        # of 16 bytes"); the experts are whole on every TP rank, so the rule is on the whole width
        "moe_expert_width": (["model.architecture={model_type: mixtral, hidden_size: 64, intermediate_size: 97, "
                              "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
                              "num_local_experts: 4, num_experts_per_tok: 2, max_position_embeddings: 256}",
                              "parallel.tp_size=2", "model.dtype=bf16"],
                             "model.architecture.intermediate_size=97 is 194 bytes in model.dtype=bf16, not a multiple "
                             "of 16: the fused MoE experts multiply with torch's grouped_mm, which needs that (step 1 "
                             "fails with 'strides should be multiple of 16 bytes'); choose intermediate_size a "
                             "multiple of 8 (e.g. 96 or 104), or set model.architecture.experts_implementation=eager"),
        # transformers first tried a Hub kernel, then raised ImportError after the model loaded
        "flash_attention_missing": (["model.attn_implementation=flash_attention_2", "data.micro_batch_size=1"],
                                    "model.attn_implementation=flash_attention_2 needs the flash-attn package, which "
                                    "is not installed in this environment; install it"),
    }[case]
    if case == "flash_attention_missing":  # an environment without flash-attn, whatever this one holds
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "flash_attn"
                            else find_spec(name, *rest))
    result = _dry_run(dry_run_here, tmp_path, *overrides)
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    assert "dry run OK" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_dry_run_prints_the_attention_mode(tmp_path, dry_run_here):
    on = _dry_run(dry_run_here, tmp_path)
    off = _dry_run(dry_run_here, tmp_path, "data.document_mask=false")
    assert on.returncode == off.returncode == 0, (on.stderr[-3000:], off.stderr[-3000:])
    assert "# attention: within each packed document (data.document_mask=true" in on.stdout
    assert "# attention: the whole packed row, across documents (data.document_mask=false)" in off.stdout


def test_dry_run_warns_about_an_output_folder_it_cannot_create(tmp_path, dry_run_here):
    """The dry run may run on a login node or a laptop: it warns (the trainer refuses, tested below)."""
    (tmp_path / "a_file").write_text("x")
    result = _dry_run(dry_run_here, tmp_path, f"train.output_dir={tmp_path / 'a_file' / 'run'}")
    assert result.returncode == 0 and "dry run OK" in result.stdout, result.stderr[-3000:]
    assert f"warning: train.output_dir={str(tmp_path / 'a_file' / 'run')!r} cannot be created" in result.stderr
    assert "is a file, not a folder" in result.stderr


# ---------------------------------------------------------------------------------------------- data files
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from ntl_pretrain.tokenizer.run import train_digit_bpe

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_digit_bpe([f"{i} apples cost {i * 7} coins" for i in range(300)], vocab_size=300, out_dir=str(out))
    return AutoTokenizer.from_pretrained(out)


def _build(tokenizer, path: Path, tmp_path: Path) -> PretrainingData:
    from ntl_pretrain.config import DataConfig

    cfg = DataConfig(sources=[DataSourceConfig(path=str(path))], seq_len=16, validation_documents=5,
                     cache_dir=str(tmp_path / "cache"))
    return PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_empty_jsonl_is_named(tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError) as info:
        _build(tokenizer, tmp_path / "empty.jsonl", tmp_path)
    assert "empty.jsonl' is empty (0 bytes)" in str(info.value) and "StopIteration" not in str(info.value)
    # one empty file in a folder of good ones is named too
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text("".join(json.dumps({"text": f"{i} + {i}"}) + "\n" for i in range(50)))
    (tmp_path / "folder" / "b.jsonl").write_text("")
    with pytest.raises(DataError, match=r"b.jsonl' is empty"):
        _build(tokenizer, tmp_path / "folder", tmp_path)


@pytest.mark.parametrize("suffix", ["jsonl", "txt"])
def test_latin1_file_is_named_with_its_line(tokenizer, tmp_path, suffix):
    lines = [f"doc {i}: {i} plus {i} is {2 * i}" for i in range(40)] + ["caf\u00e9 au lait costs 3 euros"]
    rows = [json.dumps({"text": t}, ensure_ascii=False) if suffix == "jsonl" else t for t in lines]
    path = tmp_path / f"latin.{suffix}"
    path.write_bytes(("\n".join(rows) + "\n").encode("latin-1"))
    with pytest.raises(DataError) as info:
        _build(tokenizer, path, tmp_path)
    message = str(info.value)
    assert f"latin.{suffix}' line 41 is not UTF-8 text" in message and "iconv" in message


def test_all_whitespace_corpus_is_refused(tokenizer, tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text("".join(json.dumps({"text": [" ", "\n\t", "   \n"][i % 3]}) + "\n" for i in range(300)))
    with pytest.raises(DataError, match=r"all 300 documents are empty or whitespace in column 'text'"):
        _build(tokenizer, path, tmp_path)
    # a corpus with some blank documents is fine
    path.write_text("".join(json.dumps({"text": " " if i % 2 else f"{i} plus 1"}) + "\n" for i in range(300)))
    assert _build(tokenizer, path, tmp_path).sources


# ---------------------------------------------------------------------------------------------- full runs
def _train_command(tmp_path: Path, tokenizer_dir: str, corpus: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(REPO / "launch" / "pretrain.sh"), "--config", DEMO, "tokenizer.train_vocab_size=0",
            f"tokenizer.name_or_path={tokenizer_dir}", "data.sources.0.generate_arithmetic=0",
            f"data.sources.0.path={corpus}", "data.validation_documents=0", "train.val_every_n_steps=-1",
            "eval.at_end=false", "train.max_steps=1", f"data.cache_dir={tmp_path / 'cache'}", *overrides]


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i} apples plus {i * 3} apples is {i * 4} apples."}) + "\n"
                            for i in range(400)))
    return path


def test_deepspeed_json_batch_mismatch_fails_before_the_build(tmp_path, tokenizer):
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                                                  "gradient_accumulation_steps": 3}))
    command = _train_command(tmp_path, tokenizer.name_or_path, _corpus(tmp_path), "parallel.tp_size=1",
                             f"deepspeed.config={tmp_path / 'ds.json'}", f"train.output_dir={tmp_path / 'run'}")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=rank_env(0, 1, free_port()))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "AssertionError" not in result.stderr and "Traceback" not in result.stderr
    assert "train_batch_size=64 must equal" in result.stderr and "8 x 3 x 1 = 24" in result.stderr
    assert not (tmp_path / "run").exists()


_TWO_RANKS = """
import json, subprocess, sys
commands, envs, timeout = json.loads(sys.argv[1])
procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c, e in zip(commands, envs)]
outs = []
try:
    for p in procs:
        outs.append(p.communicate(timeout=timeout)[0])
except subprocess.TimeoutExpired:
    for p in procs:
        p.kill()
    outs = [p.communicate()[0] + "\\nTIMEOUT" for p in procs]
print(json.dumps([[p.returncode for p in procs], outs]))
"""


def test_read_only_output_folder_stops_every_rank_with_one_clear_line(tmp_path, tokenizer):
    """Two ranks; the output folder exists and cannot be written (chmod for a normal user, a read-only
    bind mount for root, who ignores permissions): both exit 2 with the folder named, before any build."""
    out = tmp_path / "readonly_run"
    out.mkdir()
    port = free_port()
    command = _train_command(tmp_path, tokenizer.name_or_path, _corpus(tmp_path), "parallel.tp_size=1",
                             f"train.output_dir={out}")
    payload = json.dumps([[command, command], [rank_env(0, 2, port), rank_env(1, 2, port)], 400])
    driver = [sys.executable, "-c", _TWO_RANKS, payload]
    if os.geteuid() == 0:
        driver = ["unshare", "-m", "sh", "-c", f'mount --bind "{out}" "{out}" && mount -o remount,bind,ro "{out}" '
                  f'&& exec "$0" "$@"', *driver]
    else:
        out.chmod(0o555)
    try:
        result = subprocess.run(driver, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    finally:
        out.chmod(0o755)
    assert result.returncode == 0, result.stderr[-3000:]
    codes, outputs = json.loads(result.stdout.strip().splitlines()[-1])
    errors = []
    for rank, (code, output) in enumerate(zip(codes, outputs)):
        assert code == 2, f"rank {rank} exited {code}:\n{output[-3000:]}"
        errors += [line for line in output.splitlines() if line.startswith("error: ")]
        assert "Traceback" not in output and "gloo" not in output.lower() and "TIMEOUT" not in output
        assert "model from_config" not in output  # refused before the model was built
    # an error every rank agrees on is printed once (by rank 0), not once per rank
    assert len(errors) == 1 and f"train.output_dir={str(out)!r} is not writable" in errors[0], outputs[0][-3000:]
    assert os.listdir(out) == []


# ---------------------------------------------------------------------------------------------- umask
@pytest.fixture(params=[0o022, 0o002], ids=["umask022", "umask002"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_and_folders_follow_the_umask(tmp_path, umask):
    from ntl_pretrain.eval.arithmetic import write_training_corpus
    from ntl_pretrain.eval.hooks import _write_jsonl
    from ntl_pretrain.tokenizer.run import train_digit_bpe

    files, folders = 0o666 & ~umask, 0o777 & ~umask
    corpus = write_training_corpus(str(tmp_path / "corpus.jsonl"), n=20, seed=1)
    _write_jsonl(str(tmp_path / "eval" / "step_0000001.jsonl"), [{"a": 1}])
    tokenizer = train_digit_bpe(["1 + 2 = 3"] * 50, vocab_size=300, out_dir=str(tmp_path / "tok"))
    cfg = load_config(None, MINIMAL)
    from ntl_pretrain.config import write_resolved

    resolved = write_resolved(cfg, str(tmp_path / "run"))
    assert _mode(Path(corpus)) == files and _mode(tmp_path / "eval" / "step_0000001.jsonl") == files
    assert _mode(Path(resolved)) == files
    assert _mode(Path(tokenizer)) == folders
    assert {_mode(p) for p in Path(tokenizer).iterdir()} == {files}
    assert not [p for p in tmp_path.rglob(".*tmp*")]  # no temporary left behind


def test_atomic_helpers_leave_nothing_half_written(tmp_path, umask):
    from ntl_pretrain.core.fs import atomic_directory, atomic_write, write_json_atomic

    target = tmp_path / "a.json"
    write_json_atomic(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_write(target) as handle:
            handle.write('{"v": 2')
            raise RuntimeError("interrupted")
    assert json.loads(target.read_text()) == {"v": 1} and os.listdir(tmp_path) == ["a.json"]
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "folder") as staging:
            Path(staging, "x").write_text("x")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == ["a.json"]
    with atomic_directory(tmp_path / "folder") as staging:
        Path(staging, "x").write_text("x")
    with pytest.raises(FileExistsError):
        with atomic_directory(tmp_path / "folder") as staging:
            Path(staging, "y").write_text("y")
    assert os.listdir(tmp_path / "folder") == ["x"] and sorted(os.listdir(tmp_path)) == ["a.json", "folder"]
    assert _mode(tmp_path / "folder") == 0o777 & ~umask and _mode(target) == 0o666 & ~umask


def test_a_real_run_and_its_export_follow_the_umask(tmp_path, tokenizer):
    """Two ranks (ZeRO-3, tp 2) under umask 002 train a step and export: every file of the run folder
    and of the export, model.safetensors included (safetensors writes 0600), is group-readable and
    -writable as the umask says."""
    out = tmp_path / "run"
    port = free_port()
    command = _train_command(tmp_path, tokenizer.name_or_path, _corpus(tmp_path), "parallel.tp_size=2",
                             f"train.output_dir={out}", "checkpoint.export_hf_at_end=true",
                             f"checkpoint.export_dir={tmp_path / 'export'}")
    payload = json.dumps([[command, command], [rank_env(0, 2, port), rank_env(1, 2, port)], 500])
    result = subprocess.run([sys.executable, "-c", _TWO_RANKS, payload], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path, preexec_fn=lambda: os.umask(0o002))
    assert result.returncode == 0, result.stderr[-3000:]
    codes, outputs = json.loads(result.stdout.strip().splitlines()[-1])
    assert codes == [0, 0], outputs[0][-4000:]
    export = tmp_path / "export"
    assert (export / "model.safetensors").is_file()
    for root in (export, out):
        for path in [root, *root.rglob("*")]:
            if path.is_symlink():
                continue
            expected = 0o775 if path.is_dir() else 0o664  # (DeepSpeed's copied zero_to_fp32.py keeps its x bits)
            assert _mode(path) & expected == expected and not _mode(path) & 0o002, \
                f"{path} has mode {oct(_mode(path))}, the umask 002 gives {oct(expected)}"


# ---------------------------------------------------------------------------------------------- issue 36 items 2-3
def _dry_run_in_process(dry_run_here, tmp_path: Path, world: int, *overrides: str) -> tuple[int, str, str]:
    """`launch/pretrain.sh --dry-run` through cli.main in this process (tests/conftest.py `dry_run_here`)."""
    result = dry_run_here("--config", DEMO, "--world-size", str(world), f"train.output_dir={tmp_path / 'run'}",
                          *overrides)
    return result.returncode, result.stdout, result.stderr


@pytest.mark.parametrize("overrides,world,message", [
    # the demo has 4 heads and 2 key-value heads: tp 3 passed the dry run, then AutoTP failed with a raw AssertionError
    (["parallel.tp_size=3"], 3, "parallel.tp_size=3 does not divide the model's num_attention_heads=4"),
    (["parallel.tp_size=4"], 4, "parallel.tp_size=4 does not divide the model's num_key_value_heads=2"),
    (["parallel.tp_size=2", "model.architecture.intermediate_size=1"], 2,
     "parallel.tp_size=2 is more ranks than the model's intermediate_size=1"),
    (["train.max_steps=1000000000000000000000000000000"], 2, "train.max_steps=1000000000000000000000000000000 is more"),
    (["loss.ntl_weight=1e30"], 2, "loss.ntl_weight=1e+30 must be < 10000"),
    (["train.output_dir=/"], 2, "train.output_dir='/' is the filesystem root"),
])
def test_dry_run_refuses_sizes_and_values_the_run_cannot_use(dry_run_here, tmp_path, overrides, world, message):
    code, _, err = _dry_run_in_process(dry_run_here, tmp_path, world, *overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], (code, lines)


def test_dry_run_refuses_an_output_dir_that_is_a_dangling_link(dry_run_here, tmp_path):
    link = tmp_path / "runs_link"
    link.symlink_to(tmp_path / "gone")
    code, _, err = _dry_run_in_process(dry_run_here, tmp_path, 2, f"train.output_dir={link}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"is a symbolic link to {str(tmp_path / 'gone')!r}, which does not exist" in lines[0], lines
    assert "RunLockError" not in err and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("overrides,message", [
    (["optim.warmup_steps=1000", "train.max_steps=5"],
     "optim.warmup_steps=1000 >= train.max_steps=5: the learning rate never reaches optim.lr"),
    (["loss.ntl_weight=50"], "loss.ntl_weight=50 is far above the paper's 0.1-1"),
])
def test_dry_run_warns_of_settings_that_run_but_not_as_meant(dry_run_here, tmp_path, overrides, message):
    code, out, err = _dry_run_in_process(dry_run_here, tmp_path, 2, *overrides)
    assert code == 0 and "dry run OK" in out
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and message in warnings[0], err


@pytest.mark.parametrize("line,why", [("[1, 2, 3]", "a JSON list, not an object"), ('"a string"', "a JSON str, not an object"),
                                      ("7", "a JSON int, not an object"),
                                      ('{"text": "1+1=2", "text": "2+2=4"}', "an object whose key 'text' appears twice")])
def test_a_json_lines_row_that_is_not_an_object_is_named_by_file_and_line(tmp_path, line, why):
    """datasets' reader failed on the whole file ("check that the files are valid json data") with no line."""
    from ntl_pretrain.data.sources import load_documents

    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "12+3=15"}\n\n{"text": "4+4=8"}\n' + line + '\n{"text": "9+1=10"}\n')
    with pytest.raises(DataError) as refused:
        load_documents(DataSourceConfig(path=str(path)), "data.sources.0", str(tmp_path / "cache"))
    assert f"{str(path)!r} line 4 is {why}" in str(refused.value), refused.value


def test_a_streamed_row_with_a_key_given_twice_is_skipped_and_named(tmp_path):
    """json.loads kept the last value of a repeated key silently; the stream now skips the row and names it."""
    from ntl_pretrain.data.reader import LocalRows

    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b", "text": "c"}\n{"text": "d"}\n')
    rows = list(LocalRows([str(path)], "json", [0]).rows())
    assert [row for row, _, _ in rows] == [{"text": "a"}, "an object whose key 'text' appears twice", {"text": "d"}]
    assert rows[1][2] == f"{str(path)!r} line 2"


def test_a_source_that_is_a_symbolic_link_loop_says_so(tmp_path):
    from ntl_pretrain.data.sources import resolve_files

    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    with pytest.raises(DataError, match="is a symbolic link loop"):
        resolve_files(DataSourceConfig(path=str(loop)), "data.sources.0")
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(DataError, match="is a symbolic link to .*gone.jsonl', which does not exist"):
        resolve_files(DataSourceConfig(path=str(dangling)), "data.sources.0")


@pytest.mark.parametrize("width, dtype", [(97, "bf16"), (100, "bf16"), (104, "bf16"), (98, "fp32"), (100, "fp32")])
def test_the_grouped_experts_rule_is_torchs(width, dtype):
    """check_grouped_experts refuses exactly the Mixtral expert widths whose forward and backward fail in torch's
    grouped_mm (transformers' default experts implementation), and none of those that run."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ntl_pretrain.trainer.preflight import check_grouped_experts

    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=width, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, vocab_size=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    ids = torch.randint(0, 64, (2, 8))
    try:
        model(ids, labels=ids).loss.backward()
        runs = True
    except RuntimeError as error:
        assert "strides should be multiple of 16 bytes" in str(error)
        runs = False
    try:
        check_grouped_experts(config, dtype, from_architecture=True)
        refused = False
    except ConfigError:
        refused = True
    assert refused == (not runs), (width, dtype, runs)
    check_grouped_experts(  # the other fix the message names: no grouped_mm, no rule
        AutoConfig.for_model("mixtral", intermediate_size=width, experts_implementation="eager"),
                          dtype, from_architecture=True)
