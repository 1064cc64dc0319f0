"""Reading a configuration tree into the schema: key listing and `--help`, nearest-key suggestions for unknown
keys, and `key.sub=value` overrides (the strict YAML reading and the type-checked build: `core.typed_yaml`)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Any, Iterator

import yaml

from ..core.typed_yaml import build_dataclass, load_yaml, type_name
from .schema import Config, ConfigError


# ---------------------------------------------------------------------------------------------- keys
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_keys(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, doc) of every leaf key, sections first-to-last."""
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from iter_keys(hint, key + ".")
            continue
        item = _list_item_dataclass(hint)
        if item is not None:
            yield key, hint, _default_of(f), f.metadata.get("doc", "")
            yield from iter_keys(item, key + ".N.")
            continue
        yield key, hint, _default_of(f), f.metadata.get("doc", "")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _list_item_dataclass(hint: Any) -> type | None:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            return item
    return None


def help_text() -> str:
    """Every configuration key with its type, default and meaning (for `--help`)."""
    lines = []
    section = None
    for key, hint, default, doc in iter_keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            lines.append(f"\n[{top}]")
        lines.append(f"  {key} ({type_name(hint)}, default {default!r})\n      {doc}")
    return "\n".join(lines)


# Names other tools (HF Trainer, DeepSpeed, Megatron, torchtitan) use for a key of ours: a misspelt key
# that is one of these is pointed at our name, not at the closest spelling (learning_rate -> lr).
SYNONYMS = {
    "learning_rate": "optim.lr", "max_lr": "optim.lr", "peak_lr": "optim.lr",
    "adam_epsilon": "optim.eps", "adam_eps": "optim.eps", "adam_beta1": "optim.betas", "adam_beta2": "optim.betas",
    "max_grad_norm": "optim.grad_clip", "gradient_clipping": "optim.grad_clip", "clip_grad": "optim.grad_clip",
    "num_warmup_steps": "optim.warmup_steps", "warmup": "optim.warmup_steps", "lr_warmup_steps": "optim.warmup_steps",
    "lr_scheduler_type": "optim.lr_schedule", "lr_scheduler": "optim.lr_schedule", "min_lr": "optim.min_lr_ratio",
    "decay": "optim.weight_decay",
    "max_seq_len": "data.seq_len", "seq_length": "data.seq_len", "max_length": "data.seq_len",
    "sequence_length": "data.seq_len", "block_size": "data.seq_len", "max_seq_length": "data.seq_len",
    "batch_size": "data.micro_batch_size", "per_device_train_batch_size": "data.micro_batch_size",
    "train_micro_batch_size_per_gpu": "data.micro_batch_size", "micro_batch": "data.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps", "grad_accum": "train.grad_accum_steps",
    "train_steps": "train.max_steps", "total_steps": "train.max_steps", "steps": "train.max_steps",
    "train_iters": "train.max_steps", "logging_steps": "train.log_every_n_steps",
    "log_interval": "train.log_every_n_steps", "eval_steps": "train.val_every_n_steps",
    "eval_interval": "train.val_every_n_steps", "save_steps": "checkpoint.every_n_steps",
    "save_interval": "checkpoint.every_n_steps", "save_total_limit": "checkpoint.keep_last",
    "model_name_or_path": "model.name_or_path", "tokenizer_name": "tokenizer.name_or_path",
    "tensor_parallel_size": "parallel.tp_size", "tensor_model_parallel_size": "parallel.tp_size",
    "autotp_size": "parallel.tp_size", "tp": "parallel.tp_size", "stage": "parallel.zero_stage",
    "zero": "parallel.zero_stage", "ntl_lambda": "loss.ntl_weight", "lambda": "loss.ntl_weight",
    "lam": "loss.ntl_weight", "torch_dtype": "model.dtype", "precision": "model.dtype",
    "mixed_precision": "model.dtype", "output_path": "train.output_dir", "save_dir": "train.output_dir",
}


def _tokens(name: str) -> set[str]:
    return {t for t in name.lower().replace("-", "_").split("_") if t}


def _leaf_score(name: str, candidate: str) -> float:
    """Spelling similarity plus the share of words (split at '_') the two names have in common."""
    spelling = difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio()
    shared = len(_tokens(name) & _tokens(candidate)) / max(len(_tokens(name) | _tokens(candidate)), 1)
    return spelling + shared


def _nearest(key: str, candidates: list[str]) -> str:
    """The valid dotted key a user most likely meant: a known synonym first (in the same section when the
    section is right), then the same leaf name in another section, then the best-scoring leaf within the
    same section, then the best-scoring key overall."""
    parts = key.split(".")
    leaf, section = parts[-1], ".".join(parts[:-1])
    normalised = leaf.lower().replace("-", "_")
    synonym = SYNONYMS.get(normalised)
    if synonym is not None:
        same = [c for c in candidates if c.rsplit(".", 1)[0] == section and c.rsplit(".", 1)[-1] == synonym.rsplit(".", 1)[-1]]
        return same[0] if same else synonym
    same_leaf = [c for c in candidates if c.rsplit(".", 1)[-1] == normalised]
    if same_leaf:
        return same_leaf[0]
    siblings = [c for c in candidates if c.rsplit(".", 1)[0] == section]
    pool = siblings or candidates
    target = leaf if siblings else key
    best = max(pool, key=lambda c: _leaf_score(target, c.rsplit(".", 1)[-1] if siblings else c), default="")
    return best


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    full_valid = [k for k, *_ in iter_keys()]
    index = re.search(r"\.(\d+)\.", key)  # data.sources.3.text_feild: match as .N., answer with .3.
    pattern = re.sub(r"\.\d+\.", ".N.", key)
    nearest = _nearest(pattern, full_valid)
    if index is not None:
        nearest = nearest.replace(".N.", f".{index.group(1)}.", 1)
    nearest = nearest.replace(".N.", ".0.")
    return ConfigError(f"unknown config key {key!r} ({where}); did you mean {nearest!r}? "
                       f"See `launch/pretrain.sh --help` for every key.")


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """`cls` (the run config or one of its sections) from a mapping; an unknown key names the nearest key of the
    whole run config."""
    return build_dataclass(cls, data, prefix, unknown_key=_unknown_key_error)


# ---------------------------------------------------------------------------------------------- overrides
def _set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set `a.b.0.c` in a nested dict/list tree, creating mappings on the way (checked later)."""
    parts = key.split(".")
    node: Any = tree
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise ConfigError(f"override {key!r}: {'.'.join(parts[:depth])} is a list of {len(node)} items; "
                                  f"use an index 0..{len(node)}")
            index = int(part)
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
            else:
                if node[index] is None:
                    node[index] = {}
                node = node[index]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parts[:depth])} is not a section")
        if last:
            node[part] = value
        else:
            child = node.get(part)
            if child is None:
                child = [] if parts[depth + 1].isdigit() else {}
                node[part] = child
            node = child


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` -> (key, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"command-line argument {text!r} is not an override of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has no key before '='")
    try:
        value = load_yaml(raw, f"override {text!r}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _validate_override_key(key: str) -> None:
    """Reject an override of a key that does not exist, naming the nearest one."""
    parts = key.split(".")
    cls: Any = Config
    walked = []
    for part in parts:
        if part.isdigit() and walked and isinstance(cls, tuple):
            cls = cls[1]
            walked.append(part)
            continue
        if not dataclasses.is_dataclass(cls):
            if walked and cls is not None and dict in (typing.get_origin(cls), *map(typing.get_origin, typing.get_args(cls))):
                return  # free-form mapping (model.architecture.hidden_size, data.stages.1.weights.web)
            raise _unknown_key_error(key, [], f"{'.'.join(walked)} has no sub-keys")
        hints = _type_hints(cls)
        if part not in hints:
            raise _unknown_key_error(key, list(hints), "not a known key")
        hint = hints[part]
        item = _list_item_dataclass(hint)
        cls = ("list", item) if item is not None else hint
        walked.append(part)


def get_key(config: Config, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node
