"""The planner (`launch/pretrain.sh --plan`, `ntl_pretrain.plan`) against what real training steps hold, save, send
and write: the real Trainer and DeepSpeed ZeRO-3 engine at 2 ranks (dp 2) and 4 ranks (dp 2 x AutoTP 2), two tiny
Llama sizes each (one in bf16 with the full head, one in fp32 with the chunked head), measured by
tests/workers/plan_measure.py (one launch per world size). A formula that drifts from what the engine does fails
here:

- model states: each parameter's ZeRO-3 partition (`ds_tensor`), the optimizer's fp32 partitions, Adam's moments
  and the gradient partition buffer equal the plan's, byte for byte;
- activations: the bytes the step's forward saved for backward (saved-tensor hooks, each storage once) within
  10% of the plan;
- logits: the LM head's output shape and dtype equal the plan's;
- collectives: the step's bytes per kind and group equal the plan's;
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
# launch: (world size, tp size, {case: overrides}); DeepSpeed keeps its tensor-parallel groups for the process, so
# one layout per launch
LAUNCHES = {
    "dp2": (2, 1, {"dp2_small_chunked": [*SMALL, *CHUNKED], "dp2_larger_bf16": LARGER}),
    "dp2tp2": (4, 2, {"dp2tp2_small": SMALL, "dp2tp2_larger_bf16_chunked": [*LARGER, *CHUNKED]}),
}


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
    return root


@pytest.fixture(scope="module")
def measured(setup) -> dict:
    """Each case's per-rank measurements (tests/workers/plan_measure.py), one launch per world size."""
    root = setup
    found = {}
    for launch, (world, tp_size, cases) in LAUNCHES.items():
        cases_file = root / f"cases_{launch}.json"
        cases_file.write_text(json.dumps([{"name": name, "overrides": [f"parallel.tp_size={tp_size}", *overrides]}
                                          for name, overrides in cases.items()]))
        run_workers("plan_measure.py", world, [str(root / "out"), str(root / "config.yaml"), str(cases_file)],
                    timeout=900)
        for name in cases:
            found[name] = [json.loads((root / "out" / name / f"rank{r}.json").read_text()) for r in range(world)]
    return found
