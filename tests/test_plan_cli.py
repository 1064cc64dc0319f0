"""`launch/pretrain.sh --plan` in this process (`cli.main`): the text and JSON plans of a tiny model built from
`model.architecture`, the device-memory verdict and the layouts that fit, and the one-line errors a user can cause.
What the plan's figures are worth is tests/test_plan_measured.py's (real DeepSpeed steps)."""

from __future__ import annotations

import json

import pytest

from ntl_pretrain import cli
from ntl_pretrain.config import ConfigError
from ntl_pretrain.plan import parse_bytes

pytestmark = pytest.mark.fast

TINY = ["model.architecture.model_type=llama", "model.architecture.hidden_size=32",
        "model.architecture.intermediate_size=64", "model.architecture.num_hidden_layers=2",
        "model.architecture.num_attention_heads=4", "model.architecture.num_key_value_heads=2",
        "model.architecture.max_position_embeddings=64", "data.seq_len=32", "data.micro_batch_size=2",
        "parallel.zero_stage=3", "parallel.tp_size=1"]


@pytest.fixture
def tiny(tmp_path, monkeypatch, capfd):
    """Run `--plan ARGS` on the tiny model with a word-level tokenizer; (exit code, stdout, stderr), the process's
    file descriptors included."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>", *"0123456789", "a", "b"]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tmp_path / "tok")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str):
        capfd.readouterr()
        code = cli.main(["--plan", *args, *TINY, f"tokenizer.name_or_path={tmp_path / 'tok'}",
                         f"data.sources.0.path={tmp_path / 'corpus.jsonl'}"])
        out = capfd.readouterr()
        return code, out.out, out.err
    return run


def test_text_plan_names_every_kind(tiny):
    code, out, _ = tiny("--world-size", "4")
    assert code == 0
    for line in ("plan: 4 ranks = dp 4 x sp 1 x tp 1", "parameters", "activations", "optimizer_moments",
                 "reduce_scatter", "zero_pp_rank_N_mp_rank_N_optim_states.pt"):
        assert line in out


def test_json_plan_and_layouts_that_fit(tiny):
    code, out, _ = tiny("--world-size", "4", "--device-memory", "8GiB", "--json")
    found = json.loads(out)
    assert code == 0 and found["fits"] is True
    assert found["plan"]["device_bytes"] == sum(found["plan"]["memory"].values())
    layouts = {(item["dp_size"], item["sp_size"], item["tp_size"]) for item in found["fitting_layouts"]}
    assert (4, 1, 1) in layouts and (2, 1, 2) in layouts  # tp 4 leaves a rank no key-value head: refused
    assert any(line.startswith("tp 4 x sp 1:") for line in found["refused_layouts"])


def test_too_small_a_device_exits_3_and_says_so(tiny):
    code, out, _ = tiny("--world-size", "2", "--device-memory", "1MiB")
    assert code == 3
    assert "does NOT fit" in out and "no layout of 2 ranks fits" in out


def test_plan_needs_a_world_size(tiny):
    code, _, err = tiny()
    assert code == 2 and "--plan needs --world-size N" in err


@pytest.mark.parametrize("text,size", [("80GiB", 80 * 2**30), ("141GB", 141 * 10**9), ("1024", 1024),
                                       ("0.5 TiB", 2**39)])
def test_device_memory_sizes(text, size):
    assert parse_bytes(text) == size


def test_device_memory_that_is_not_a_size():
    with pytest.raises(ConfigError, match="--device-memory '80 gigs' is not a size"):
        parse_bytes("80 gigs")


def test_a_hub_model_not_cached_names_where_to_get_its_config(tiny):
    """Without the model's config.json there is nothing to plan: one line saying where to get it."""
    code, _, err = tiny("--world-size", "2", "model.name_or_path=ntl-pretrain-tests/no-such-model",
                        "model.architecture={}")
    assert code == 2
    assert "--plan needs the model's config.json" in err and "examples/model_configs/" in err


@pytest.mark.parametrize("memory", ["", "0", "0GiB"])
def test_a_device_memory_of_nothing_is_refused(tiny, memory):
    """'' planned without a verdict and 0 said nothing fits; both are no device."""
    code, out, err = tiny("--world-size", "2", "--device-memory", memory)
    assert code == 2 and out == ""
    assert f"--device-memory {memory!r} is not a size; give a device's memory above 0" in err


def test_json_plan_is_alone_on_stdout(tiny, monkeypatch):
    """What libraries print while the plan is made (DeepSpeed's accelerator line goes to the process's stdout, at
    its first use in a new process) goes to stderr: stdout is the JSON alone, for `--json > plan.json`."""
    import os

    from ntl_pretrain.plan import report

    make_plan = report.make_plan

    def noisy_make_plan(*args, **kwargs):
        print("[WARNING] [real_accelerator.py] Setting accelerator to CPU.")
        os.write(1, b"a line written to the process's stdout\n")
        return make_plan(*args, **kwargs)

    monkeypatch.setattr(report, "make_plan", noisy_make_plan)
    code, out, err = tiny("--world-size", "2", "--device-memory", "8GiB", "--json")
    assert code == 0 and json.loads(out)["fits"] is True
    assert "Setting accelerator to CPU" in err and "the process's stdout" in err
