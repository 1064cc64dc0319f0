"""The planner (`launch/pretrain.sh --plan`, `ntl_pretrain.plan`) against what real training steps hold, save, send
and write: the real Trainer and DeepSpeed ZeRO-3 engine at 2 ranks (dp 2) and 4 ranks (dp 2 x AutoTP 2), two tiny
Llama sizes each (fp32 and bf16, the full and the chunked head; at dp 2 one case with activation checkpointing,
one without persistent parameters and with two micro-batches a step), and 2 ranks of Ulysses (sp 2), measured by
tests/workers/plan_measure.py (one launch per layout). A formula that drifts from what the engine does fails here:

- model states: each parameter's AutoTP slice and ZeRO-3 partition (`ds_tensor`), the optimizer's fp32
  partitions, Adam's moments and the gradient partition buffer equal the plan's, byte for byte;
- gathered parameters: the most bytes ZeRO-3 holds gathered at once equal the plan's working set;
- activations: the bytes one micro-batch's forward saved for backward (saved-tensor hooks, each storage once)
  within 10% of the plan;
- logits: the LM head's output shape and dtype equal the plan's;
- collectives: the step's bytes per kind and group equal the plan's (and the calls on the tp and sp groups);
- checkpoint: the saved files' names equal the plan's, and the tensor bytes of each file equal the plan's.
"""

from __future__ import annotations

import json

import pytest

from helpers.distributed import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1200)]

WORDS = ["[UNK]", "[PAD]", "</s>", "the", "answer", "is", "plus", "minus", "times", "equals", "0", "1", "2", "3",
         "4", "5", "6", "7", "8", "9", ".", ",", "apples", "cost", "and", "of", "to", "a", "we", "get", "so", "it"]
CONFIG = """\
model:
  architecture: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
                 num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64,
                 tie_word_embeddings: false}}
  dtype: fp32
  attn_implementation: sdpa
  pad_vocab_to_multiple_of: 8
tokenizer: {{name_or_path: {root}/tokenizer}}
data:
  sources: [{{path: {root}/corpus.jsonl, text_field: text}}]
  seq_len: 32
  micro_batch_size: 2
  validation_documents: 0
  document_mask: false
loss: {{enabled: true, ntl_weight: 0.3, variant: was}}
parallel: {{tp_size: 1, zero_stage: 3}}
optim: {{lr: 0.001, lr_schedule: constant, warmup_steps: 1}}
train: {{max_steps: 5, val_every_n_steps: -1, log_every_n_steps: 1}}
checkpoint: {{every_n_steps: 0, save_final: false, keep_last: 0}}
eval: {{at_end: false}}
monitor: {{progress_bar: never}}
"""
SMALL = []
LARGER = ["model.architecture.hidden_size=64", "model.architecture.intermediate_size=160",
          "model.architecture.num_hidden_layers=3", "model.architecture.num_attention_heads=8",
          "model.architecture.num_key_value_heads=4", "model.dtype=bf16", "data.seq_len=48"]
CHUNKED = ["loss.chunk_tokens=20"]
# no persistent parameters (every one gathered and released as a large model's are) and two micro-batches a step
GATHERED = ["deepspeed.config={root}/ds_no_persistence.json", "train.grad_accum_steps=2"]
# launch: (world size, tp size, {case: overrides}); DeepSpeed keeps its tensor-parallel groups for the process, so
# one layout per launch
LAUNCHES = {
    "dp2": (2, 1, {"dp2_small_chunked_unpersisted": [*SMALL, *CHUNKED, *GATHERED], "dp2_larger_bf16": LARGER,
                   "dp2_small_checkpointed": [*SMALL, "model.gradient_checkpointing=true"]}),
    "dp2tp2": (4, 2, {"dp2tp2_small": SMALL, "dp2tp2_larger_bf16_chunked": [*LARGER, *CHUNKED],
                      "dp2tp2_small_checkpointed": [*SMALL, "model.gradient_checkpointing=true"],
                      # the head tied to the embedding: both one vocabulary shard, the lookup all-reduced
                      "dp2tp2_small_tied": [*SMALL, "model.architecture.tie_word_embeddings=true"]}),
    "sp2": (2, 1, {"sp2_bf16": ["parallel.sp_size=2", "model.dtype=bf16"],
                   "sp2_checkpointed": ["parallel.sp_size=2", "model.gradient_checkpointing=true"]}),
}


def case_overrides(overrides: list[str], root) -> list[str]:
    return [override.format(root=root) for override in overrides]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tokenizer, the corpus and the config the launches train on."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("plan_measured")
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="</s>")
    tokenizer.save_pretrained(root / "tokenizer")
    lines = [" ".join(WORDS[3 + (i * 7 + j) % (len(WORDS) - 3)] for j in range(60)) for i in range(60)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    (root / "config.yaml").write_text(CONFIG.format(root=root))
    (root / "ds_no_persistence.json").write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    return root


@pytest.fixture(scope="module")
def measured(setup) -> dict:
    """Each case's per-rank measurements (tests/workers/plan_measure.py), one launch per world size."""
    root = setup
    found = {}
    for launch, (world, tp_size, cases) in LAUNCHES.items():
        cases_file = root / f"cases_{launch}.json"
        cases_file.write_text(json.dumps([{"name": name, "overrides": [f"parallel.tp_size={tp_size}", *case_overrides(
            overrides, root)]} for name, overrides in cases.items()]))
        run_workers("plan_measure.py", world, [str(root / "out"), str(root / "config.yaml"), str(cases_file)],
                    timeout=900)
        for name in cases:
            found[name] = [json.loads((root / "out" / name / f"rank{r}.json").read_text()) for r in range(world)]
    return found


BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def planned(setup, name: str):
    """The plan of case `name`, made in this process from its config alone (the ranks' device: CPU, as measured)."""
    from ntl_pretrain.config import load_config
    from ntl_pretrain.plan import make_plan
    from ntl_pretrain.trainer.preflight import preflight

    world, tp_size, cases = next(launch for launch in LAUNCHES.values() if name in launch[2])
    cfg = load_config(str(setup / "config.yaml"), [f"parallel.tp_size={tp_size}", *case_overrides(cases[name], setup),
                                                   f"train.output_dir={setup / 'plan_run'}"])
    return make_plan(preflight(cfg, world, on_cpu=True, local_files_only=True), world, device_type="cpu")


CASES = [name for _, _, cases in LAUNCHES.values() for name in cases]


@pytest.mark.parametrize("name", CASES)
def test_model_states_equal_the_engines_partitions(setup, measured, name):
    """Per rank: each parameter's AutoTP slice and ZeRO-3 partition, and the bytes of the parameter partition, the
    gradient partition buffer, the fp32 master partition and Adam's moments, as DeepSpeed's engine holds them."""
    plan = planned(setup, name)
    by_name = {p.name: p for p in plan.parameters}
    for rank in measured[name]:
        states = rank["model_states"]
        assert sorted(p["name"] for p in states["params"]) == sorted(by_name)
        for param in states["params"]:
            mine = by_name[param["name"]]
            assert (param["ds_numel"], param["partition_numel"]) == (
                mine.tp_numel, -(-mine.tp_numel // plan.partitions)), param["name"]
        item = BYTES[states["params"][0]["dtype"]]
        assert plan.memory["parameters"] == sum(p["partition_numel"] for p in states["params"]) * item
        assert plan.memory["persistent_parameters"] == sum(p["ds_numel"] for p in states["params"]
                                                           if p["persistent"]) * item
        grads = states["grad_buffer"]
        assert plan.memory["gradients"] == grads["numel"] * BYTES[grads["dtype"]]
        assert not any(part["shares_params"] for part in states["fp32"])
        assert plan.memory["master_weights"] == sum(part["numel"] * BYTES[part["dtype"]] for part in states["fp32"])
        assert plan.memory["optimizer_moments"] == sum(m["numel"] * BYTES[m["dtype"]] for m in states["moments"])


@pytest.mark.parametrize("name", CASES)
def test_gathered_parameters_equal_the_engines_peak(setup, measured, name):
    """The most bytes of non-persistent parameters ZeRO-3 held gathered at once in the step: the plan's working set
    (these models are far under stage3_max_live_parameters + stage3_prefetch_bucket_size, so both are the whole
    model's non-persistent parameters; none at all where every parameter is persistent)."""
    plan = planned(setup, name)
    for rank in measured[name]:
        assert rank["gathered_peak"] == plan.memory["gathered_parameters"]


@pytest.mark.parametrize("name", CASES)
def test_activations_within_ten_percent_of_a_real_step(setup, measured, name):
    """The bytes a real step's micro-batch saved for backward (each storage once, parameters left out) are within
    10% of the plan's activations, in the decoder layers and in all. Under activation checkpointing the hooks see
    what the forward keeps (each layer's inputs, the rest), not the one layer recomputed inside the checkpoint's
    own hooks in backward, which the plan adds (the same traced layer as without checkpointing)."""
    plan = planned(setup, name)
    kept = plan.memory["activations"]
    if plan.batch["gradient_checkpointing"]:
        kept -= plan.batch["activation_bytes_per_layer"]
    for rank in measured[name]:
        saved = rank["saved"]
        if not plan.batch["gradient_checkpointing"]:  # checkpointed layers save their inputs before their own hooks
            layers = plan.model["layers"] * plan.batch["activation_bytes_per_layer"]
            assert abs(saved["layers"] - layers) <= 0.1 * saved["layers"], (saved, layers)
        total = saved["layers"] + saved["rest"]
        assert abs(total - kept) <= 0.1 * total, (saved, kept)


@pytest.mark.parametrize("name", [name for name in CASES if "chunked" not in name])
def test_logits_equal_the_heads_output(setup, measured, name):
    """The full head's logits on each rank: the planned bytes are those of the LM head's output in the step."""
    plan = planned(setup, name)
    for rank in measured[name]:
        (logits,) = rank["logits"]
        numel = 1
        for size in logits["shape"]:
            numel *= size
        assert plan.memory["logits"] == numel * BYTES[logits["dtype"]]


@pytest.mark.parametrize("name", CASES)
def test_collectives_equal_a_counted_step(setup, measured, name):
    """The step's all-gathers and reduce-scatters on the ZeRO-3 group, all-reduces on the tensor-parallel group and
    Ulysses' all-to-alls and position gathers on the sequence-parallel group carry the planned bytes (the
    tensor- and sequence-parallel ones in the planned number of calls); every other collective of the step is
    bookkeeping under 1 KiB a call (logged figures, small broadcasts)."""
    from ntl_pretrain.parallel.layout import ParallelLayout

    plan = planned(setup, name)
    zero_name = "dp x sp" if plan.sp_size > 1 else "dp"
    for rank in measured[name]:
        layout = ParallelLayout.of(rank["world_size"], rank["rank"], rank["rank"], plan.tp_size, plan.sp_size)
        planned_kind = {  # (torch.distributed function, its group) -> (the plan's kind, group)
            ("all_gather_into_tensor", layout.peers("loss")): ("all_gather", zero_name),
            ("reduce_scatter_tensor", layout.peers("loss")): ("reduce_scatter", zero_name),
            ("all_reduce", layout.peers("tp") if plan.tp_size > 1 else None): ("all_reduce", "tp"),
            ("all_to_all_single", layout.peers("sp") if plan.sp_size > 1 else None): ("all_to_all", "sp"),
            ("all_gather", layout.peers("sp") if plan.sp_size > 1 else None): ("all_gather", "sp")}
        totals = {kind: [0, 0] for kind in planned_kind.values()}
        for call in rank["collectives"]:
            kind = planned_kind.get((call["name"], tuple(call["ranks"])))
            if kind is None:
                assert call["bytes"] < 1024, call
                continue
            totals[kind][0] += 1
            totals[kind][1] += call["bytes"]
        for (kind, group), (calls, size) in totals.items():
            items = [t for t in plan.traffic if (t["kind"], t["group"]) == (kind, group)]
            assert size == sum(t["bytes"] for t in items), (kind, group, totals, items)
            if group in ("tp", "sp"):
                assert calls == sum(t["calls"] for t in items), (kind, group, totals, items)


@pytest.mark.parametrize("name", CASES)
def test_checkpoint_files_equal_a_real_save(setup, measured, name):
    """The saved checkpoint's per-rank files are the planned ones, each holding the planned tensor bytes; the run
    files (manifest, hf/) are there besides."""
    plan = planned(setup, name)
    files = measured[name][0]["checkpoint"]["files"]
    per_rank = {name: entry for name, entry in files.items() if name.endswith(".pt")}
    assert {f["name"]: f["tensor_bytes"] for f in plan.checkpoint["files"]} == {
        name: entry["tensor_bytes"] for name, entry in per_rank.items()}
    assert "ntl_checkpoint.json" in files and any(name.startswith("hf/") for name in files)
    assert plan.checkpoint["bytes"] == sum(entry["tensor_bytes"] for entry in per_rank.values())
