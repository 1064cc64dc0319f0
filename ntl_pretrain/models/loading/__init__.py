"""Partitioned model loading under ZeRO-3: each rank holds only its share of the weights.

The plain path (`from_pretrained` on every rank) gives every rank the whole model before
`deepspeed.initialize` partitions it: memory-mapped when the files' dtype is the training dtype (its
pages become resident as `deepspeed.initialize` broadcasts and partitions each parameter), a converted
copy in memory otherwise (e.g. fp32 or fp16 files trained in bf16), so 8 ranks hold 8 copies. Here:

1. the model is constructed under `deepspeed.zero.Init` as transformers does under ZeRO-3, without
   weight initialisation (each module is partitioned as soon as it is built: only one module is ever
   whole), and
2. each rank reads from the safetensors files only the elements of its own ZeRO-3 partition of each
   parameter (a row range read at its byte offset, at most two rows more than its share) and writes
   them into `param.ds_tensor`; no parameter is gathered and no rank reads the full file.

Vocabulary growth (`model.resize_embeddings`) is done while reading: the embedding (and untied head)
are constructed with the padded row count and each rank fills its rows with the file's row, the row of
another spelling of a new digit, or the mean of the trained rows, with the same plan as
`tokenizer.resize.resize_model_embeddings` (`plan_new_rows`).

`deepspeed.initialize` accepts the partitioned model as it is (it skips parameters that already have a
`ds_id`).

With tensor parallelism (AutoTP, T > 1) DeepSpeed 0.19 shards the model inside `deepspeed.initialize`
and has no pre-sharded entry point (`deepspeed.tp_model_init` only records arguments; a model built
under `zero.Init` is gathered module by module in `AutoTP._gather_zero3_params`, each rank then holding
its ZeRO share *and* its TP slice). Its layers do keep meta tensors on meta (`TensorParallel_Layer.move`),
slicing only their shape, and record each slice in `ds_autotp_uc_meta` (partition dim and sizes). So the
model's linear and embedding weights are built on the meta device (everything else, small, is read
whole), DeepSpeed's own AutoTP decides every slice, and right after it (a wrapper around
`DeepSpeedEngine._configure_tensor_parallel`, before ZeRO-3 partitions the slices over the data-parallel
group) each rank reads from the files exactly the rows/columns of its slices. No rank holds more than
its TP slice of any weight (1/T of the model); the vocabulary resize and padding happen while reading.

Modules: `reading` (safetensors byte-range reads, resize rows, parameters the files hold as several tensors
joined by transformers' own conversion: an MoE's fused experts), `zero3` (T=1: the partitioned build and
load), `autotp` (T>1: the slice reads after AutoTP); `load_pretrained_partitioned` picks one.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from .autotp import _tp_slice, check_tp_load_filled, fill_tp_slices, load_tp_sliced  # noqa: F401 (tests, trainer)
from .reading import full_numel, full_shape, safetensors_files  # noqa: F401 (the package's API)
from .zero3 import build_from_config_partitioned, load_partitioned, partitioned_load_applies  # noqa: F401

logger = logging.getLogger(__name__)


def load_pretrained_partitioned(cfg: Any, config: Any, tokenizer: Any, ds_config: dict, tp_size: int, *,
                                attn_implementation: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any | None]:
    """`model.name_or_path` loaded partitioned (T=1: each rank's ZeRO-3 share, `load_partitioned`; T>1: each
    rank's AutoTP slices, `load_tp_sliced`), its vocabulary grown to hold `tokenizer` (padded to a multiple of
    lcm(`pad_vocab_to_multiple_of`, T)) when `model.resize_embeddings` asks, as `model.build_model` does on
    the full model.

    Returns the model and the `ResizeReport` (None when nothing was resized).
    """
    from ...tokenizer.resize import plan_new_rows

    folder = os.path.expanduser(cfg.name_or_path)
    if not os.path.isdir(folder):  # a hub id: the same files from_pretrained would fetch, into the HF cache
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, allow_patterns=["*.json", "*.safetensors"])
    old_rows = int(config.vocab_size)
    plan = None
    if cfg.resize_embeddings and len(tokenizer) > old_rows:
        plan = plan_new_rows(tokenizer, old_rows, math.lcm(cfg.pad_vocab_to_multiple_of, tp_size))
        plan.check_mean()
        config.vocab_size = plan.new_rows
    if tp_size == 1:
        model = load_partitioned(folder, config, ds_config, attn_implementation=attn_implementation, dtype=dtype,
                                 trust_remote_code=cfg.trust_remote_code, row_plan=plan)
    else:
        model = load_tp_sliced(folder, config, ds_config, attn_implementation=attn_implementation, dtype=dtype,
                               trust_remote_code=cfg.trust_remote_code, row_plan=plan)
    if plan is None:
        return model, None
    input_embeddings, output_embeddings = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output_embeddings is not None and output_embeddings.weight is input_embeddings.weight
    return model, plan.report("mean", tied, tokenizer)
