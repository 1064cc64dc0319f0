#!/usr/bin/env python
"""Start-up host memory per rank: the partitioned ZeRO-3 load against every rank loading the full model.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python tools/bench_startup.py --arch qwen2.5-0.5b --dtype bf16 \\
        --out bench_startup.json

Writes a model of a real published architecture (the config written out below, no hub) with random
weights as safetensors into a temporary folder, then starts the real `Trainer` on 2 CPU ranks for each
case (T=1 ZeRO-3 partitioned; T=2 ZeRO-3 with AutoTP, each rank reading its TP slices; and both with
`model.partitioned_load=false`: every rank loads the full model first, the path before) and
reads each rank's peak RSS (VmHWM in /proc/self/status, reset to the current RSS as `build_model`
starts) at four points: after `build_model`, after AutoTP sliced the model inside `deepspeed.initialize`
(T>1; with the sliced load, its reads of each rank's slices done), after `deepspeed.initialize` (end of
`Trainer.__init__`) and after the first optimizer step. Figures are multiples of the model's bytes (parameters x bytes of
the training dtype), raw and above the rank's RSS as `build_model` starts (Python, torch, DeepSpeed, the
tokenizer and the data are already there). After `deepspeed.initialize`
the optimizer's own state (fp32 master partition, then Adam moments and gradients at the first step)
comes on top whatever the loading; the loading decides the first figure and what initialise adds to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from ntl_pretrain.runtime.supervisor import free_port  # noqa: E402

SHARED_TOKENIZERS = "/work/shared/data/tokenizers"
# Published configs (config.json on the hub), written out: Qwen/Qwen2.5-0.5B, HuggingFaceTB/SmolLM2-135M,
# TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
ARCHITECTURES = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True, use_sliding_window=False,
        sliding_window=32768, max_window_layers=24, bos_token_id=151643, eos_token_id=151643),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
    "tinyllama-1.1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # an MoE: Qwen/Qwen3-30B-A3B's layer (hidden 2048, 32 query and 4 key-value heads of 128, experts of width 768,
    # top-8) with 4 of its 48 layers and 16 of its 128 experts, and SmolLM2's vocabulary (so the experts are about
    # half of the model, as in the real one, not the embeddings)
    "qwen3-moe-4l16e": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=16,
        num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True, vocab_size=49152,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
}
# a real tokenizer for each (GPT-2's 50257 tokens exceed SmolLM2's 49152 rows: that run resizes while loading);
# for Qwen2.5, GPT-2's grown with added tokens to Qwen2.5's 151665 tokens (the trainer refuses a tokenizer far
# smaller than the model's vocabulary)
TOKENIZER_OF = {"qwen2.5-0.5b": ("gpt2", 151665), "smollm2-135m": ("gpt2", 0), "tinyllama-1.1b": ("llama2", 0),
                "qwen3-moe-4l16e": ("gpt2", 0)}
CASES = (("T=1 ZeRO-3 partitioned", 1, True), ("T=1 ZeRO-3 full load", 1, False), ("T=2 ZeRO-3 TP slices", 2, True),
         ("T=2 ZeRO-3 full load", 2, False))


def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Set VmHWM to the current RSS (Linux >= 4.0: "5" into /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as handle:
        handle.write("5")


def make_model(folder: str, arch: str, dtype: str) -> int:
    """Random weights (normal 0.02, norms 1) of `arch` saved as safetensors; returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ntl_pretrain.models.build import DTYPES

    spec = dict(ARCHITECTURES[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.tie_weights()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def tokenizer_folder(arch: str, tmp: str) -> str:
    """The run's tokenizer: a shared one, grown with added tokens to the architecture's token count if given."""
    name, size = TOKENIZER_OF[arch]
    source = os.path.join(SHARED_TOKENIZERS, name)
    if not size:
        return source
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(size - len(tokenizer))])
    folder = os.path.join(tmp, "tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


def worker(args: argparse.Namespace) -> None:
    import ntl_pretrain.trainer.engine as engine
    import ntl_pretrain.trainer.trainer as train
    from ntl_pretrain.config import load_config

    figures = {"after_imports_rss_kib": status_kib("VmRSS")}
    build_model = engine.build_model

    def recording_build_model(*a, **k):
        figures["before_build_hwm_kib"] = status_kib("VmHWM")  # tokenizer and data preparation
        figures["baseline_kib"] = status_kib("VmRSS")
        reset_peak_rss()
        model, report = build_model(*a, **k)
        figures["after_build_hwm_kib"] = status_kib("VmHWM")
        from deepspeed.runtime.engine import DeepSpeedEngine

        slice_model = DeepSpeedEngine._configure_tensor_parallel  # AutoTP (T>1), with the sliced load's reads

        def recording_slice_model(*b, **c):
            result = slice_model(*b, **c)
            figures["after_tp_hwm_kib"] = status_kib("VmHWM")
            return result

        DeepSpeedEngine._configure_tensor_parallel = recording_slice_model
        return model, report

    engine.build_model = recording_build_model
    cfg = load_config(None, json.loads(args.overrides))
    started = time.perf_counter()
    trainer = train.Trainer(cfg)
    figures["after_initialize_hwm_kib"] = status_kib("VmHWM")
    figures["start_s"] = time.perf_counter() - started
    if not args.no_step:
        trainer.train_step()
        figures["after_step_hwm_kib"] = status_kib("VmHWM")
    figures["parameters"] = trainer.parts.model_report.parameters
    with open(f"{args.worker}.rank{trainer.parts.layout.rank}.json", "w", encoding="utf-8") as handle:
        json.dump(figures, handle)


def run_case(tmp: str, name: str, overrides: list[str], timeout: float, no_step: bool) -> list[dict]:
    prefix = os.path.join(tmp, name.replace(" ", "_").replace("=", "").replace("(", "").replace(")", ""))
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        command = [sys.executable, os.path.abspath(__file__), "--worker", prefix, "--overrides", json.dumps(overrides)]
        procs.append(subprocess.Popen(command + (["--no-step"] if no_step else []), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        raise SystemExit(f"{name}: the ranks did not finish within {timeout:.0f}s") from None
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"{name} failed:\n" + "\n----\n".join(out[-3000:] for out in outputs))
    result = []
    for rank in range(2):
        with open(f"{prefix}.rank{rank}.json", encoding="utf-8") as handle:
            result.append(json.load(handle))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen2.5-0.5b")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="training dtype")
    parser.add_argument("--file-dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="dtype of the saved weights (default: --dtype); e.g. fp32 files trained in bf16")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per case")
    parser.add_argument("--cases", default="0,1,2,3",
                        help="indices into the case list (0: T=1 partitioned, 1: T=1 full, 2: T=2 slices, 3: T=2 full)")
    parser.add_argument("--from-scratch", action="store_true",
                        help="build the architecture from its config (no model.name_or_path; T=1 cases only make "
                             "sense: T>1 builds whole)")
    parser.add_argument("--no-step", action="store_true",
                        help="stop after deepspeed.initialize (the first step adds Adam moments and gradients, "
                             "about 5x the share in bytes, whatever the loading)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--make", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.make:
        print(make_model(args.make, args.arch, args.file_dtype or args.dtype))
        return 0
    tmp = tempfile.mkdtemp(prefix="bench-startup-")
    try:
        return _bench(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench(args: argparse.Namespace, tmp: str) -> int:
    model_dir = os.path.join(tmp, "model")
    file_dtype = args.file_dtype or args.dtype
    if args.from_scratch:
        file_dtype = "none"
        # a YAML flow mapping; floats with a decimal point (YAML 1.1 reads "1e-06" as a string)
        architecture = ", ".join(f"{key}: {f'{value:.6e}' if isinstance(value, float) else json.dumps(value)}"
                                 for key, value in ARCHITECTURES[args.arch].items())
        model_source = [f"model.architecture={{{architecture}}}"]
        parameters = None  # from the first run's report (the vocabulary is the tokenizer's, padded)
    else:
        # in a child process, so this one never holds the model
        make = [sys.executable, os.path.abspath(__file__), "--make", model_dir, "--arch", args.arch,
                "--file-dtype", file_dtype]
        parameters = int(subprocess.run(make, check=True, capture_output=True, text=True).stdout.split()[-1])
        model_source = [f"model.name_or_path={model_dir}"]
    common = model_source + [f"model.dtype={args.dtype}", "model.attn_implementation=sdpa",
              f"tokenizer.name_or_path={tokenizer_folder(args.arch, tmp)}",
              f"data.sources=[{{path: {os.path.join(tmp, 'arithmetic.jsonl')}, generate_arithmetic: 200}}]",
              "data.seq_len=64", "data.micro_batch_size=1", "data.validation_documents=0",
              f"data.cache_dir={os.path.join(tmp, 'cache')}", "loss.enabled=false", "model.resize_embeddings=true",
              "train.val_every_n_steps=-1",
              "train.max_steps=1", "monitor.progress_bar=never"]
    results = []
    for index in (int(i) for i in args.cases.split(",")):
        name, tp, partitioned = CASES[index]
        overrides = common + [f"parallel.tp_size={tp}", "parallel.zero_stage=3",
                              f"model.partitioned_load={'true' if partitioned else 'false'}",
                              f"train.output_dir={os.path.join(tmp, f'run{index}')}"]
        ranks = run_case(tmp, name, overrides, args.timeout, args.no_step)
        if not results:
            parameters = ranks[0]["parameters"]
            model_bytes = parameters * (2 if args.dtype == "bf16" else 4)
            print(f"{args.arch} ({parameters / 1e6:.0f}M parameters, {args.dtype}: {model_bytes / 2**30:.2f} GiB; "
                  f"{'from scratch' if args.from_scratch else f'files in {file_dtype}'}), 2 CPU ranks; peak RSS per "
                  f"rank (VmHWM) / model bytes, raw (above the rank's RSS as build_model starts)")
            print(f"{'case':<26} {'rank':>4} {'after build_model':>20} {'after AutoTP':>20} {'after initialize':>20} "
                  f"{'after step 1':>20}")
        for rank, fig in enumerate(ranks):
            cells = []
            for key in ("after_build_hwm_kib", "after_tp_hwm_kib", "after_initialize_hwm_kib", "after_step_hwm_kib"):
                if key not in fig:
                    cells.append("-")
                    continue
                raw = fig[key] * 1024 / model_bytes
                above = (fig[key] - fig["baseline_kib"]) * 1024 / model_bytes
                fig[key.replace("_kib", "_x_model")] = round(raw, 3)
                fig[key.replace("_kib", "_above_baseline_x_model")] = round(above, 3)
                cells.append(f"{raw:.2f}x ({above:.2f}x)")
            print(f"{name:<26} {rank:>4} " + " ".join(f"{c:>20}" for c in cells), flush=True)
        results.append({"case": name, "tp_size": tp, "partitioned_load": partitioned, "ranks": ranks})
    if args.out:
        from ntl_pretrain.core.fs import write_json_atomic

        write_json_atomic(args.out, {"arch": args.arch, "dtype": args.dtype, "file_dtype": file_dtype,
                                     "parameters": parameters, "from_scratch": args.from_scratch,
                                     "model_bytes": model_bytes, "results": results}, indent=1)
    return 0


if __name__ == "__main__":
    from ntl_pretrain.parallel import distributed

    distributed.run_process(main)
