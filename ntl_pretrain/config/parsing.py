"""Reading a configuration tree into the schema: key listing and `--help`, nearest-key suggestions for unknown
keys, type coercion against the dataclass hints, and `key.sub=value` overrides."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Iterator, Literal

import yaml

from .schema import Config, ConfigError


# ---------------------------------------------------------------------------------------------- YAML
# A run's YAML is a few hundred nodes; this bounds what aliases can expand it to (a "billion laughs" file
# loads in microseconds as shared objects, but every later walk of it, asdict, the dump, the checks, is
# exponential).
MAX_YAML_NODES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (at any depth, flow or block)
    and a document that aliases would expand beyond MAX_YAML_NODES nodes (or into a cycle)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: explicit keys beside it override the merged ones, as YAML means
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error names it
            if first is not key_node:
                places = (f"lines {_line(first)} and {_line(key_node)}" if _line(first) != _line(key_node) else
                          f"line {_line(key_node)}, columns {first.start_mark.column + 1} and "
                          f"{key_node.start_mark.column + 1}")
                raise ConfigError(f"{_where(key_node)}: key {key!r} is given twice ({places}); the second would "
                                  f"silently replace the first, keep one")
        return super().construct_mapping(node, deep=deep)

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _check_expanded_size(node)
        return node


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _where(node: yaml.Node) -> str:
    return _described(node.start_mark.name)


def _described(name: str) -> str:
    """What an error calls the text `load_yaml` read: "file 'run.yaml'" or "override 'key=value'"."""
    return name if name.startswith("override ") else f"file {name!r}"


def _check_expanded_size(root: yaml.Node) -> None:
    """The number of nodes `root` stands for with every alias expanded, counted once per distinct node
    (linear in the file, whatever the aliases multiply to); a cycle or a size over MAX_YAML_NODES is refused."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[id(node)] > MAX_YAML_NODES:
                raise ConfigError(f"{_where(root)}: holds more than {MAX_YAML_NODES} values counting what its aliases "
                                  f"(*name) expand to (from line {_line(node)}); a configuration this large is refused")
            continue
        if id(node) in on_path:
            raise ConfigError(f"{_where(root)}: line {_line(node)} holds an alias inside its own anchor (a "
                              f"recursive structure), which a configuration cannot be")
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def load_yaml(text: str, name: str) -> Any:
    """A YAML document as Python values, refusing duplicate keys and alias bombs (see _StrictLoader);
    `name` (a file's path, or "override 'key=value'") is what errors and line marks name."""
    loader = _StrictLoader(text)
    loader.name = name  # the marks (line numbers) of every node and error carry it
    try:
        return loader.get_single_data()
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{_described(name)}: collections nested too deeply to read; a configuration is a few levels "
                          f"deep") from None
    finally:
        loader.dispose()


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


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    if typing.get_origin(hint) is Literal:
        return " | ".join(str(choice) for choice in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join("None" if option is type(None) else _type_name(option) for option in typing.get_args(hint))
    return str(hint).replace("typing.", "")


def help_text() -> str:
    """Every configuration key with its type, default and meaning (for `--help`)."""
    lines = []
    section = None
    for key, hint, default, doc in iter_keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            lines.append(f"\n[{top}]")
        lines.append(f"  {key} ({_type_name(hint)}, default {default!r})\n      {doc}")
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


# ---------------------------------------------------------------------------------------------- typing
def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check (and where lossless, convert) a YAML value against a field's type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        if len(errors) > 1:  # int | Literal["auto"]: name every kind of value the key takes
            expected = " or ".join(_expected(option) for option in options if option is not type(None))
            raise ConfigError(f"{key} must be {expected}, got {type(value).__name__} {value!r}")
        raise ConfigError(errors[0] if errors else f"{key}: cannot be null")
    if hint is Any:
        return value
    if origin is Literal:
        for choice in typing.get_args(hint):
            if value == choice and type(value) is type(choice):  # true is not 1, "3" is not 3
                return choice
        raise ConfigError(f"{key}={value!r} is not one of {_choices(hint)}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of {hint.__name__} keys, got {value!r}")
        return _build(hint, value, key + ".")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {type(value).__name__} {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {type(value).__name__} {value!r}")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:  # YAML 1.1 reads "1e-4" (no dot) as a string
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(number):  # .nan slips through every `< 0` check; .inf means nothing here
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {type(value).__name__} {value!r}; quote it in YAML")
    raise ConfigError(f"{key}: unsupported type {hint}")


def _choices(hint: Any) -> str:
    """The allowed values of a Literal type, as a user writes them."""
    return ", ".join(str(choice) for choice in typing.get_args(hint))


def _expected(hint: Any) -> str:
    """What a value of type `hint` is, in words (for an error naming every kind a key takes)."""
    if typing.get_origin(hint) is Literal:
        return f"one of {_choices(hint)}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, _type_name(hint))


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if not isinstance(key, str):  # `yes:`, `on:`, `1:` are a bool and an int to YAML 1.1
            raise ConfigError(f"config key {key!r} in [{prefix.rstrip('.') or 'top level'}] is not a name: YAML reads "
                              f"unquoted yes/no/on/off/true/false and numbers as values; quote it or fix the key")
        if key not in names:
            raise _unknown_key_error(f"{prefix}{key}", names, f"not a key of [{prefix.rstrip('.') or 'top level'}]")
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}") for name, value in data.items()}
    return cls(**kwargs)


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
            if walked and cls is not None and typing.get_origin(cls) is dict:
                return  # free-form mapping (model.architecture.hidden_size)
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
