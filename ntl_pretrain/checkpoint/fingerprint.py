"""What a resume must find unchanged: the model, tokenizer and number vocabulary (`fingerprint`), the data
configuration (`data.data_description`, compared here by `check_data`) and the learning-rate schedule
(`lr_schedule_description`)."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from ..core.lr_schedules import scheduler_class as lr_scheduler_class
from ..core.hashing import short_sha as _sha
from .format import CheckpointError

logger = logging.getLogger("ntl_pretrain")

# HF config keys that do not change what the weights mean (so they stay out of the fingerprint)
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "architectures",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "_commit_hash",
    "output_attentions", "output_hidden_states", "return_dict", "_experts_implementation",
})


def model_fingerprint(model_config: Any) -> str:
    """Hash of a transformers config without the keys that do not change what the weights mean."""
    config = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    return _sha({k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS})


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of how a tokenizer maps text to ids (vocabulary, merges, normalizer, pre-tokenizer, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)  # runtime settings, not the mapping
        spec.pop("padding", None)
        return _sha(spec)
    return _sha(sorted(tokenizer.get_vocab().items()))


def fingerprint(model_config: Any, tokenizer: Any, number_vocab: Any) -> dict[str, Any]:
    """What a resume must find unchanged: the model's config, the tokenizer, the NTL number vocabulary."""
    return {
        "model": model_fingerprint(model_config),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "number_vocab": _sha({"ids": list(number_vocab.token_ids), "values": list(number_vocab.values)}),
        "model_type": getattr(model_config, "model_type", None),
        "vocab_size": getattr(model_config, "vocab_size", None),
        "tokenizer_size": len(tokenizer),
    }


def check_fingerprint(saved: dict, current: dict, where: str) -> None:
    """Raise naming the first difference between a checkpoint's fingerprint and this run's."""
    fixes = {
        "model": "model (architecture or vocabulary size)",
        "tokenizer": "tokenizer (vocabulary or how it splits text)",
        "number_vocab": "NTL number vocabulary (tokenizer.digit_level or the tokenizer)",
    }
    for key, what in fixes.items():
        if key in saved and saved[key] != current[key]:
            detail = ""
            if key == "model":
                detail = (f" (saved: {saved.get('model_type')}, vocabulary {saved.get('vocab_size')}; this run: "
                          f"{current.get('model_type')}, vocabulary {current.get('vocab_size')})")
            elif key == "tokenizer":
                detail = f" (saved: {saved.get('tokenizer_size')} tokens; this run: {current.get('tokenizer_size')})"
            raise CheckpointError(
                f"checkpoint {where} was saved with a different {what} than this run{detail}; fingerprint "
                f"{saved[key]} != {current[key]}. Resume with the model and tokenizer it was trained with, or "
                f"export it (tools/export_hf.py) and start a new run from the export in another train.output_dir")


def describe_changes(saved: Any, current: Any, prefix: str) -> str:
    """`key: saved -> current` for each leaf that differs (at most 6)."""
    changes: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k), b.get(k), f"{key}.{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}.{i}")
        elif a != b:
            changes.append(f"{key}: {json.dumps(a, default=str)} -> {json.dumps(b, default=str)}")

    walk(saved, current, prefix)
    return "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")


DOCUMENT_MASK = "document_mask"  # the data description's key of data.document_mask


def check_document_mask(saved: dict, current: dict, where: str, allow_change: bool) -> None:
    """Refuse a resume that switches data.document_mask (the model continues under attention it was not trained
    with), unless checkpoint.allow_data_change (logged). A checkpoint that does not record it was written before
    the key existed, when attention spanned the whole packed row: it counts as false."""
    trained, now = bool(saved.get(DOCUMENT_MASK, False)), bool(current.get(DOCUMENT_MASK, False))
    if trained == now:
        return
    recorded = "" if DOCUMENT_MASK in saved else " (it predates the key: attention then spanned the packed row)"
    if not allow_change:
        raise CheckpointError(
            f"checkpoint {where} was trained with data.document_mask={str(trained).lower()}{recorded}, this run sets "
            f"data.document_mask={str(now).lower()}: resume with data.document_mask={str(trained).lower()}, or set "
            f"checkpoint.allow_data_change=true to switch the attention mode from here on")
    logger.warning("checkpoint %s was trained with data.document_mask=%s; continuing with %s because "
                   "checkpoint.allow_data_change=true", where, str(trained).lower(), str(now).lower())


def stages_of(description: dict) -> list[list]:
    """A data description's stages as [start step, weights]: its recorded data.stages, or one stage from step 1
    by the sources' weights (a run without stages, and checkpoints written before them)."""
    return description.get("stages") or [[1, [source.get("weight") for source in description.get("sources", [])]]]


def _without_weights(description: dict) -> dict:
    """A data description less what decides the mixture (compared by stage, `check_data`)."""
    rest = {key: value for key, value in description.items() if key != "stages"}
    rest["sources"] = [{k: v for k, v in source.items() if k != "weight"} for source in description.get("sources", [])]
    return rest


def check_data(saved: dict | None, current: dict, where: str, allow_change: bool, step: int = 0) -> None:
    """Refuse a resume whose data configuration differs from the checkpoint's (samples would repeat or be
    skipped, validation documents could leak into training), unless the user allows it (logged).

    The mixture is compared by stage (`stages_of`): the stages that began by the checkpoint's `step` decided what
    was trained and must be unchanged (start step and weights); a later stage may be edited, added or removed, as
    continued pretraining is planned on (logged)."""
    if saved is None:
        logger.warning("checkpoint %s records no data configuration (saved before format 2): the data sources are "
                       "not compared, only data.seed and data.seq_len", where)
        return
    check_document_mask(saved, current, where, allow_change)
    saved, current = ({k: v for k, v in d.items() if k != DOCUMENT_MASK} for d in (saved, current))
    if saved == current:
        return
    trained, kept = ([stage for stage in stages_of(d) if stage[0] <= step] for d in (saved, current))
    staged = "stages" in saved or "stages" in current  # else the sources' weights are compared as any key
    same_rest = staged and _without_weights(saved) == _without_weights(current)
    if same_rest and trained == kept:
        logger.warning("checkpoint %s (step %d) was saved with other data stages after step %d (%s): the steps "
                       "already trained had the same stages; the edited ones apply from their start steps", where,
                       step, step, _stage_changes(stages_of(saved), stages_of(current)))
        return
    if not allow_change and same_rest:
        raise CheckpointError(
            f"checkpoint {where} trained steps 1-{step} with data stages that this run changes "
            f"({_stage_changes(trained, kept)}): the steps already trained would not be the ones this configuration "
            f"describes. Keep the stages that start at or before step {step} as they were (start_step and weights) "
            f"and edit only later ones, or set checkpoint.allow_data_change=true if you mean it")
    changes = describe_changes(saved, current, "data")
    if not allow_change:
        raise CheckpointError(
            f"checkpoint {where} was saved with another data configuration than this run's ({changes}); resuming "
            f"would continue its sample stream on other data (samples repeat or are skipped, validation documents "
            f"may enter training). Resume with the saved data settings, or set checkpoint.allow_data_change=true "
            f"if you mean it")
    logger.warning("checkpoint %s was saved with another data configuration (%s); continuing because "
                   "checkpoint.allow_data_change=true: the stream position is reused on the new data", where, changes)


def _stage_changes(saved: list[list], current: list[list]) -> str:
    """`data.stages.K: from step S, weights [...] -> ...` for each stage that differs."""
    def text(stage: list | None) -> str:
        return "none" if stage is None else f"from step {stage[0]}, weights {stage[1]}"

    return "; ".join(f"data.stages.{k}: {text(a)} -> {text(b)}" for k, (a, b) in
                     enumerate(zip(saved + [None] * len(current), current + [None] * len(saved))) if a != b)


def lr_schedule_description(ds_config: dict) -> dict:
    """The learning-rate schedule a DeepSpeed config builds: its scheduler section and the optimizer's lr."""
    return {"scheduler": ds_config.get("scheduler"),
            "lr": (ds_config.get("optimizer") or {}).get("params", {}).get("lr")}


def lr_text(schedule: dict, steps_done: int) -> str:
    """The lr of step steps_done + 1 under a schedule, as DeepSpeed's scheduler computes it (optimizer step k
    runs at the scheduler's iteration k: the trainer starts it at 1)."""
    section = schedule.get("scheduler") or {}
    try:
        scheduler_class = lr_scheduler_class(section["type"])
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(schedule.get("lr") or 0.0))
        scheduler = scheduler_class(optimizer, **section.get("params", {}), last_batch_iteration=steps_done + 1)
        return f"{scheduler.get_lr()[0]:.3e}"
    except (KeyError, AttributeError, TypeError, ValueError):
        return "(not computable here)"
