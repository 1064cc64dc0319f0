"""Export of a checkpoint (any ZeRO stage 1-3, any TP size) as a Hugging Face model folder, and the assets
every checkpoint carries so that it exports on its own."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from ..fs import apply_umask_modes, commit_directory
from .format import HF_DIR, MANIFEST_NAME, STAGING_MARKER, STAGING_SUFFIX, CheckpointError, folder_bytes
from .integrity import verify_checkpoint
from .safe_loading import safe_load
from .staging import make_staging, remove_staging
from .universal import convert_to_universal, universal_path

def write_hf_assets(folder: str, model_config: Any, tokenizer: Any, number_vocab: Any) -> None:
    """What an export needs besides the weights: config.json, generation_config.json, the tokenizer and the
    NTL number vocabulary (a few files, saved into every checkpoint so that it exports on its own)."""
    from transformers import GenerationConfig

    os.makedirs(folder, exist_ok=True)
    model_config.save_pretrained(folder)
    GenerationConfig.from_model_config(model_config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    number_vocab.save(folder)


def _full_weights(checkpoint_path: str, manifest: dict, scratch: str,
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Unsharded fp32 weights of a checkpoint: from its universal form (made in `scratch` if needed).

    DeepSpeed's universal form has two layouts of `zero/<name>/fp32.pt`: a dict whose "param" holds the
    full tensor (ZeRO 1/2, and AutoTP's merge of tensor-parallel slices) and, for ZeRO-3 without tensor
    parallelism, the bare flat tensor; a flat tensor takes its shape from the model (`shapes`), and a
    size that matches no expected shape is an error. Every file is unpickled weights-only.
    """
    layout = manifest["layout"]
    if layout["zero_stage"] == 0:
        if layout["tp_size"] != 1:
            raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with ZeRO stage 0 and tp_size "
                                  f"{layout['tp_size']}; export covers ZeRO 1-3 with any tp_size and ZeRO 0 with tp_size 1")
        state = safe_load(os.path.join(checkpoint_path, "mp_rank_00_model_states.pt"), "model states")
        return {name: tensor.float() for name, tensor in state["module"].items()}
    if manifest.get("universal_of"):
        universal = checkpoint_path
    elif os.path.isfile(os.path.join(universal_path(checkpoint_path), MANIFEST_NAME)):
        universal = convert_to_universal(checkpoint_path, verified=True)  # verifies the existing universal form
    else:
        universal = convert_to_universal(checkpoint_path, os.path.join(scratch, "universal"), verified=True)
    zero = os.path.join(universal, "zero")
    weights = {}
    for name in sorted(os.listdir(zero)):
        fp32 = os.path.join(zero, name, "fp32.pt")
        if not os.path.isfile(fp32):
            continue
        stored = safe_load(fp32, "universal checkpoint file")
        tensor = stored["param"] if isinstance(stored, dict) else stored
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"universal checkpoint file {fp32!r} holds a {type(stored).__name__}, not a tensor "
                                  f"or a dict with 'param'")
        expected = shapes.get(name)
        if expected is not None and tuple(tensor.shape) != tuple(expected) and tensor.numel() == math.prod(expected):
            tensor = tensor.reshape(expected)  # ZeRO-3 without TP: stored flat
        weights[name] = tensor
    return weights


def export_hf(checkpoint_path: str, out_dir: str, *, dtype: str | None = None, max_shard_size: str | int = "5GB") -> dict:
    """Export a checkpoint folder (any ZeRO stage 1-3, any TP size; CPU only) as a Hugging Face model folder.

    Writes safetensors weights sharded by `max_shard_size` (with `model.safetensors.index.json` when there
    are several shards), config.json, generation_config.json, the tokenizer and number_vocab.json, all
    into `out_dir` (which must not exist or be empty; written under a staging name and renamed).

    Args:
        checkpoint_path: `RUN/global_stepN` (or its universal form).
        out_dir: the new Hugging Face folder.
        dtype: bf16 | fp16 | fp32; default: the training dtype recorded in the checkpoint's config.json.
        max_shard_size: largest shard, e.g. "5GB" or a number of bytes.
    Returns:
        {"seconds", "bytes", "parameters", "files"} of the export.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    manifest = verify_checkpoint(checkpoint_path)
    assets = os.path.join(checkpoint_path, HF_DIR)
    if not os.path.isfile(os.path.join(assets, "config.json")):
        raise CheckpointError(f"checkpoint {checkpoint_path!r} has no {HF_DIR}/config.json to export with")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointError(f"export folder {out_dir!r} already exists and is not empty; choose another one "
                              f"(nothing was overwritten)")
    config = AutoConfig.from_pretrained(assets)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype is not None and dtype not in dtypes:
        raise CheckpointError(f"dtype={dtype!r} is not one of {', '.join(dtypes)}")
    saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    target = dtypes[dtype] if dtype else (saved_dtype if isinstance(saved_dtype, torch.dtype) else
                                          getattr(torch, str(saved_dtype or "float32").replace("torch.", "")))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.abspath(out_dir).rstrip("/") + STAGING_SUFFIX
    remove_staging(staging)  # an interrupted export of ours; anything else there is refused, not deleted
    make_staging(staging)
    scratch = tempfile.mkdtemp(prefix=".ntl_export_scratch_", dir=parent)
    try:
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config)
        expected = reference.state_dict()
        weights = _full_weights(checkpoint_path, manifest, scratch,
                                {name: tuple(tensor.shape) for name, tensor in expected.items()})
        tied = set(getattr(reference, "_tied_weights_keys", None) or [])
        if isinstance(getattr(reference, "_tied_weights_keys", None), dict):
            tied = set(reference._tied_weights_keys)
        if getattr(config, "tie_word_embeddings", False):
            tied |= {"lm_head.weight"}
            for name in tied:  # the tied copy holds the input embedding's values; DeepSpeed's conversion
                weights.pop(name, None)  # may give it one TP shard only (ZeRO 1/2 without its own fragments)
        missing = sorted(set(expected) - set(weights) - tied)
        if missing:
            raise CheckpointError(f"checkpoint {checkpoint_path!r} lacks weights the model needs: {missing[:5]}")
        state = {}
        for name, tensor in weights.items():
            if name not in expected:
                continue
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise CheckpointError(f"checkpoint {checkpoint_path!r}: {name} has shape {tuple(tensor.shape)}, the "
                                      f"model expects {tuple(expected[name].shape)}")
            state[name] = tensor.to(target).contiguous()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_torch_state_dict(state, staging, max_shard_size=max_shard_size, metadata={"format": "pt"})
        config.dtype = target
        config.architectures = [type(reference).__name__]
        config.save_pretrained(staging)
        for name in os.listdir(assets):
            if name != "config.json":
                shutil.copy2(os.path.join(assets, name), os.path.join(staging, name))
        os.remove(os.path.join(staging, STAGING_MARKER))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    apply_umask_modes(staging)  # safetensors writes its shards 0600: teammates could not read the export
    commit_directory(staging, out_dir)  # replaces an empty out_dir (checked above)
    return {"seconds": time.perf_counter() - started, "bytes": folder_bytes(out_dir),
            "parameters": sum(t.numel() for t in state.values()), "files": sorted(os.listdir(out_dir))}
