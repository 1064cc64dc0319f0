"""Throughput of the training loop: tokens/s and step time over a logging window, model FLOP/s and MFU.

The step reads nothing from the device between logging steps, so its time is measured over the window
between two reads (as torchtitan does): the read at a logging step waits for every step of the window, and
the window's wall time divided by its steps is the mean step time. Validation, checkpoints and evaluation
inside a window are paused out.

Model FLOPs per token follow the PaLM MFU convention: 6 x (parameters in matrix products) + 12 x layers x
hidden x seq_len (attention scores and values), forward and backward, no activation recomputation counted.
MFU divides the achieved FLOP/s of one device by its peak dense bf16/fp16 FLOP/s (`PEAK_TFLOPS`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

# Peak dense bf16/fp16 tensor-core TFLOP/s per device (vendor data sheets, without sparsity), by a
# substring of torch.cuda.get_device_name(); the first match wins, so longer names come first.
PEAK_TFLOPS = (
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 125.0),
    ("A10", 125.0), ("A6000", 155.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("V100", 125.0),
    ("T4", 65.0), ("MI300X", 1307.0), ("MI250X", 383.0),
)


def peak_tflops_per_device(device: torch.device) -> float | None:
    """Peak dense TFLOP/s of `device` from `PEAK_TFLOPS`; None on a CPU or a GPU not in the table."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def model_flops_per_token(model_config: Any, parameters: int, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matrix-product parameters + 12 x layers x hidden x seq_len.

    `model_config`: the transformers config (hidden_size, num_hidden_layers, tie_word_embeddings);
    `parameters`: the model's parameter count; `vocab_size`: its (padded) vocabulary.
    """
    hidden, layers = model_config.hidden_size, model_config.num_hidden_layers
    # The input embedding is a lookup, not a matrix product (unless tied, where it is the head too).
    lookup = 0 if getattr(model_config, "tie_word_embeddings", False) else vocab_size * hidden
    return 6.0 * (parameters - lookup) + 12.0 * layers * hidden * seq_len


class ThroughputWindow:
    """Steps, tokens and wall time since the last logging read; `read()` closes the window.

    Args:
        world_size: devices of the job (for the per-device figures).
        flops_per_token: `model_flops_per_token` of the model.
        peak_tflops: one device's peak (`peak_tflops_per_device`); None: no MFU.
    """

    def __init__(self, world_size: int, flops_per_token: float, peak_tflops: float | None) -> None:
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.restart()

    def restart(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.paused_s = 0.0
        self.started = time.perf_counter()

    def add(self, tokens: int) -> None:
        """One optimizer step of `tokens` tokens (global) was queued."""
        self.steps += 1
        self.tokens += tokens

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Work that is not a training step (validation, a checkpoint, evaluation) is not counted."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - started

    def read(self) -> dict[str, float]:
        """The window's figures, after the device finished its steps (call right after the logging read)."""
        seconds = max(time.perf_counter() - self.started - self.paused_s, 1e-9)
        tokens_per_s = self.tokens / seconds
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        figures = {"train/tokens_per_s": tokens_per_s, "train/tokens_per_s_per_device": tokens_per_s / self.world_size,
                   "train/step_time_s": seconds / max(self.steps, 1), "train/tflops_per_device": tflops}
        if self.peak_tflops:
            figures["train/mfu"] = tflops / self.peak_tflops
        self.restart()
        return figures
