"""Every family of `ntl_pretrain.models.families.FAMILIES` on a tiny model of its own transformers config class
with its published features (`TINY`): the real Trainer's first step at T=1 and at T=2 (2 CPU ranks, ZeRO-3, NTL
on, the default load: partitioned from the saved folder) has the CE, NTL, loss and gradient norm of plain
transformers + ntloss in one process (at T=2 split as the family's own layer specs say, and exporting what T=1
exports), or, where the table says the family cannot run so, the Trainer refuses it with the table's line
before the model is built (and `--dry-run` with the same line). One launch per tensor-parallel size runs every
family. Single-process: `parallel.tp_size=auto` picks only sizes the family can run; the export layout
(`published_state_dict`) equals `save_pretrained`'s and reloads; docs/training.md's table is the registry's.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers.distributed import REPO, run_workers
from ntl_pretrain.models.families import FAMILIES, family_problem

WORDS = ["[UNK]", "[PAD]", "</s>", "the", "answer", "is", "plus", "minus", "times", "equals", "7", "3", "0", "9",
         "1", "5", "2", "8", "4", "6", ".", ",", "apples", "cost", "and", "of", "to", "a", "we", "get", "so", "it"]
NTL_WEIGHT = 0.5
COMMON = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=64)
# each family's published features at tiny shapes (8 heads, 2 key-value heads: T=2 divides them; no weight has
# the head's shape (vocabulary 32 x hidden 64), which the tied-head placeholder of the partitioned build matches)
TINY = {
    "llama": dict(tie_word_embeddings=False, **COMMON),
    "qwen2": dict(tie_word_embeddings=True, **COMMON),
    "qwen3": dict(tie_word_embeddings=True, head_dim=8, **COMMON),
    "mistral": dict(sliding_window=8, tie_word_embeddings=False, **COMMON),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                    logits_scaling=8.0, tie_word_embeddings=True, **COMMON),
    "smollm3": dict(no_rope_layer_interval=2, tie_word_embeddings=True, **COMMON),
    "starcoder2": dict(sliding_window=8, use_bias=True, tie_word_embeddings=False, **COMMON),
    "gemma3_text": dict(head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0, **COMMON),
    "gemma2": dict(head_dim=8, sliding_window=8, query_pre_attn_scalar=8, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, **COMMON),
    "phi3": dict(partial_rotary_factor=0.75, tie_word_embeddings=True, **COMMON),  # Phi-4-mini's features
    "olmo2": dict(tie_word_embeddings=False, **COMMON),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                      tie_word_embeddings=False, **COMMON),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False, **COMMON),
    "gpt_neox": dict(rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, hidden_size=64,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, max_position_embeddings=64),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, bias=False, hidden_size=64,
                   num_hidden_layers=2, num_attention_heads=8, max_position_embeddings=64),
}
CONFIG = """\
model: {{dtype: fp32, attn_implementation: eager}}
tokenizer: {{name_or_path: {root}/tokenizer}}
data:
  sources: [{{path: {root}/corpus.jsonl, text_field: text}}]
  seq_len: 16
  micro_batch_size: 2
  validation_documents: 0
loss: {{enabled: true, ntl_weight: {ntl_weight}, variant: was}}
parallel: {{zero_stage: 3}}
optim: {{lr: 0.01, lr_schedule: constant, warmup_steps: 1, grad_clip: 0.0}}
train: {{max_steps: 1, val_every_n_steps: -1, log_every_n_steps: 1}}
checkpoint: {{every_n_steps: 0, save_final: false}}
eval: {{at_end: false}}
monitor: {{progress_bar: never}}
"""
TP_SIZES = (1, 2)
# the families whose T=2 run also exports: split by their own layer specs (MoE experts replicated, Phi-3's halves),
# or through a fused query_key_value (split per head or key-value group)
T2_EXPORTED = [name for name, family in FAMILIES.items() if family.tp_layer_specs] + ["gpt_neox", "falcon"]


def tiny_config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=len(WORDS), pad_token_id=None, bos_token_id=None,
                                eos_token_id=None, **TINY[model_type])


def tiny_model(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager").eval()


def test_every_family_has_a_tiny_model():
    assert set(TINY) == set(FAMILIES)


def write_setup(root, model_types=tuple(FAMILIES)):
    """The tokenizer, each family's (of `model_types`) saved tiny model, the corpus, the config and the fixed batch,
    under `root`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="</s>")
    tokenizer.save_pretrained(root / "tokenizer")
    for model_type in model_types:
        tiny_model(model_type).save_pretrained(root / model_type)
    lines = [" ".join(WORDS[3 + (i * 7 + j) % (len(WORDS) - 3)] for j in range(40)) for i in range(20)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    (root / "config.yaml").write_text(CONFIG.format(root=root, ntl_weight=NTL_WEIGHT))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, len(WORDS), (2, 17), generator=generator)
    tokens[1, ::2] = torch.randint(10, 20, (9,), generator=generator)  # digits in both vocabulary shards
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    torch.save(batch, root / "batch.pt")
    return root, tokenizer, batch


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return write_setup(tmp_path_factory.mktemp("families"))


def _cases(root, tp: int) -> list[dict]:
    """Each family with the default load at `tp`, and with the full load where the table says to use it."""
    cases = []
    for model_type in FAMILIES:
        overrides = [f"model.name_or_path={root / model_type}", f"parallel.tp_size={tp}", f"data.micro_batch_size={tp}"]
        default_runs = family_problem(model_type, tp, partitioned_load=True) is None
        # at T=1 the run that trains also saves and exports (test_export_is_the_published_layout_and_reloads), at
        # T=2 too for a family split other than by plain rows and columns (test_export_at_t2_equals_t1)
        export = tp == 1 or model_type in T2_EXPORTED
        cases.append({"name": f"{model_type}_t{tp}", "overrides": overrides, "export": export and default_runs})
        if not default_runs and not family_problem(model_type, tp, False):
            cases.append({"name": f"{model_type}_t{tp}_full", "overrides": [*overrides, "model.partitioned_load=false"],
                          "export": export})
    return cases


@pytest.fixture(scope="module")
def results(setup) -> dict:
    """{case name: the worker's record}: one 2-rank launch per TP size, every family in it."""
    root = setup[0]
    found = {}
    for tp in TP_SIZES:
        cases = _cases(root, tp)
        (root / f"cases_t{tp}.json").write_text(json.dumps(cases))
        run_workers("model_families.py", 2, [str(root), str(root / "batch.pt"), str(root / "config.yaml"),
                                             str(root / f"cases_t{tp}.json")], timeout=120 + 20 * len(cases))
        found.update({case["name"]: json.loads((root / f"{case['name']}.json").read_text()) for case in cases})
    return found


def _reference(setup, model_type: str) -> dict[str, float]:
    """Plain transformers + ntloss in one process: the step's CE, NTL, loss and gradient norm on the whole batch."""
    import ntloss
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    root, tokenizer, batch = setup
    model = AutoModelForCausalLM.from_pretrained(root / model_type, dtype=torch.float32, attn_implementation="eager")
    logits = model(input_ids=batch["input_ids"]).logits
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    ntl = ntloss.NTLoss(tokenizer, vocab_size=len(WORDS), digit_level=True, reweigh=False)(logits, batch["labels"])
    loss = ce + NTL_WEIGHT * ntl
    loss.backward()  # the gradient norm: replicated parameters neither missed nor counted or summed twice at T=2
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return {"train/ce": ce.item(), "train/ntl": ntl.item(), "train/loss": loss.item(), "train/grad_norm": grad_norm.item()}


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_trains_or_is_refused_before_the_build(setup, results, model_type: str, tp: int):
    """The default load trains with plain transformers' step-1 figures, or is refused (before the model is built)
    with the table's line; where that line says model.partitioned_load=false, that run trains."""
    result = results[f"{model_type}_t{tp}"]
    assert "error" not in result, result["error"]
    problem = family_problem(model_type, tp, partitioned_load=True)
    if problem is not None:
        assert result == {"refused": problem, "built": False}
        if "set model.partitioned_load=false" not in problem:
            return
        result = results[f"{model_type}_t{tp}_full"]
        assert "error" not in result, result["error"]
    assert "figures" in result, result
    for tag, expected in _reference(setup, model_type).items():
        assert result["figures"][tag] == pytest.approx(expected, rel=1e-5, abs=1e-6), (tag, result["figures"])
    if tp > 1:  # really tensor-parallel: layer 0 split, as the family's own layer specs say where it has them
        assert any(_LAYER_0.search(name) for name in result["split"]), result["split"]
        _assert_split_as_the_layer_specs(setup[0], model_type, set(result["split"]))


_LAYER_0 = re.compile(r"\.(layers|h)\.0\.")  # a parameter of the first decoder layer (Falcon's are transformer.h.N)


def _assert_split_as_the_layer_specs(root, model_type: str, split: set[str]) -> None:
    """Layer 0's parameters that the family's `tp_layer_specs` split (column/row) are split, the others whole."""
    from transformers import AutoModelForCausalLM

    specs = FAMILIES[model_type].tp_layer_specs
    if not specs:
        return
    model = AutoModelForCausalLM.from_pretrained(root / model_type, dtype=torch.float32)
    for name, _ in model.named_parameters():
        if not _LAYER_0.search(name):
            continue
        spec = next((spec for spec in specs if any(re.match(p, name) for p in spec["patterns"])), None)
        assert (name in split) == (spec is not None and spec["partition_type"] != "skip"), (name, sorted(split))


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_export_is_the_published_layout_and_reloads(setup, results, model_type: str):
    """The export of a T=1 ZeRO-3 checkpoint holds the tensor names and shapes the family's own save_pretrained
    writes (the reference: a save_pretrained of the same architecture), and from_pretrained loads it whole."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root = setup[0]
    name = _trained_case(model_type, 1)
    assert "figures" in results[name], results[name]
    export = root / f"{name}_hf"

    def layout(folder) -> dict[str, tuple[int, ...]]:
        found = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                found.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
        return found

    reference = root / f"{model_type}_save_pretrained"
    AutoModelForCausalLM.from_pretrained(root / model_type, dtype=torch.float32).save_pretrained(reference)
    assert layout(export) == layout(reference)
    _, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def _trained_case(model_type: str, tp: int) -> str:
    """The case of `model_type` at `tp` that trains: the default load, or the full load where it is refused."""
    return f"{model_type}_t{tp}" + ("" if family_problem(model_type, tp, partitioned_load=True) is None else "_full")


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model_type", T2_EXPORTED)
def test_export_at_t2_equals_t1(setup, results, model_type: str):
    """A T=2 run split by the family's own layer specs or through a fused query_key_value exports, after its step,
    the weights of the same step at T=1 (the TP slices merged back: replicated layers and MoE experts once, Phi-3's
    gate_up_proj halves and the per-head-group slices of a fused qkv in place)."""
    from safetensors.torch import load_file

    root = setup[0]
    exported = {tp: load_file(root / f"{_trained_case(model_type, tp)}_hf" / "model.safetensors") for tp in TP_SIZES}
    assert exported[2].keys() == exported[1].keys()
    # Adam's first step is lr * g / (|g| + eps): gradients near eps turn summation-order differences (1e-7) into
    # up to ~1e-4 here, while a slice merged in the wrong place moves a weight by its size (init std 0.02)
    for key, tensor in exported[1].items():
        torch.testing.assert_close(exported[2][key], tensor, rtol=0, atol=1e-3, msg=key)


def _config(root, *overrides: str):
    from ntl_pretrain.config import load_config

    return load_config(str(root / "config.yaml"), [f"train.output_dir={root / 'run'}", *overrides])


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_dry_run_refuses_what_the_trainer_refuses_and_auto_picks_a_size_that_runs(setup, model_type: str, capsys):
    """`--dry-run` at 2 processes gives the Trainer's refusal (the launches above) for each TP size, and
    parallel.tp_size=auto picks 2 only where T=2 runs with the default load."""
    from ntl_pretrain.config import ConfigError
    from ntl_pretrain.trainer.ds_config import resolve_run
    from ntl_pretrain.trainer.preflight import dry_run

    root = setup[0]
    for tp in TP_SIZES:
        cfg = _config(root, f"model.name_or_path={root / model_type}", f"parallel.tp_size={tp}")
        problem = family_problem(model_type, tp, partitioned_load=True)
        if problem is None:
            dry_run(cfg, 2)
            assert "# dry run OK" in capsys.readouterr().out
        else:
            with pytest.raises(ConfigError) as refused:
                dry_run(cfg, 2)
            assert str(refused.value) == problem
    auto = resolve_run(_config(root, f"model.name_or_path={root / model_type}", "parallel.tp_size=auto"), True, 2)
    assert auto.cfg.parallel.tp_size == (1 if family_problem(model_type, 2, partitioned_load=True) else 2)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_published_state_dict_is_the_save_pretrained_layout_and_reloads(tmp_path, model_type: str):
    """The in-memory weights in the family's published layout: the key names and shapes `save_pretrained` of the
    same model writes, the same values, and `from_pretrained` of them gives the model back."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.models.families import published_state_dict

    model = tiny_model(model_type)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    in_memory = {name: param.detach() for name, param in model.named_parameters()}  # tied weights once
    published = published_state_dict(model, in_memory)
    assert {k: tuple(v.shape) for k, v in published.items()} == {k: tuple(v.shape) for k, v in saved.items()}
    for key, tensor in saved.items():
        assert torch.equal(published[key], tensor), key
    model.config.save_pretrained(tmp_path / "export")
    save_file({k: v.contiguous() for k, v in published.items()}, tmp_path / "export" / "model.safetensors",
              metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    expected = model.state_dict()
    assert reloaded.state_dict().keys() == expected.keys()
    for key, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[key]), key


def test_docs_table_is_the_registry():
    from ntl_pretrain.models.families import families_table

    assert families_table() in (REPO / "docs" / "training.md").read_text(encoding="utf-8")


def test_a_config_json_transformers_refuses_is_one_line_naming_the_folder(tmp_path):
    """transformers 5 validates configs strictly (huggingface_hub's StrictDataclassError, neither ValueError nor
    OSError): a config.json with vocab_size "60", tie_word_embeddings null or 3 heads for hidden size 16, and the
    same in model.architecture, were raw tracebacks from --dry-run and the trainer."""
    from transformers import LlamaConfig

    from ntl_pretrain.config import ModelConfig
    from ntl_pretrain.models.build import load_model_config

    good = LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2).to_dict()
    for key, value, message in (("vocab_size", "60", "Field 'vocab_size' expected int, got str"),
                                ("tie_word_embeddings", None, "Field 'tie_word_embeddings' expected bool"),
                                ("num_attention_heads", 3, "hidden size (16) is not a multiple of the number of "
                                                           "attention heads (3)"),
                                ("vocab_size", -1, "has vocab_size=-1")):  # accepted, then a negative tensor size
        folder = tmp_path / f"{key}_{value}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(ValueError) as info:
            load_model_config(ModelConfig(name_or_path=str(folder)))
        text = str(info.value)
        assert f"the model config of '{folder}' (model.name_or_path)" in text, text
        assert message in text and "\n" not in text and ("fix its config.json" in text or "vocabulary size" in text), text
    with pytest.raises(ValueError) as info:
        load_model_config(ModelConfig(architecture={"model_type": "llama", "hidden_size": 16, "num_attention_heads": 3}))
    assert str(info.value).startswith("model.architecture (llama) is refused by transformers") and "\n" not in str(
        info.value)


@pytest.mark.fast
def test_a_family_whose_files_the_partitioned_load_cannot_read_is_refused_in_one_line(monkeypatch):
    """No listed family needs it now; the registry's refusal still names the family, the size and the fix."""
    from ntl_pretrain.models import families

    monkeypatch.setitem(families.FAMILIES, "toy", families.Family("Toy", no_tp_partitioned_load="its qkv is interleaved"))
    assert family_problem("toy", 1, partitioned_load=True) is None
    assert family_problem("toy", 2, partitioned_load=False) is None
    problem = family_problem("toy", 2, partitioned_load=True)
    assert "Toy (toy) at parallel.tp_size=2" in problem and "its qkv is interleaved" in problem
    assert "set model.partitioned_load=false" in problem and "\n" not in problem
    assert "| Toy (`toy`) | trains | trains with `model.partitioned_load=false` | T=1 |" in families.families_table()
