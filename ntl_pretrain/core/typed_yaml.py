"""Typed YAML: a YAML document read strictly (no key given twice, no alias bomb) and a dataclass built from a
mapping with every value checked against its field's type. The run's configuration and the evaluation settings
both read through it; the errors are `ConfigError`s naming the key."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Literal

import yaml

from .errors import ConfigError

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


def type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    if typing.get_origin(hint) is Literal:
        return " | ".join(str(choice) for choice in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join("None" if option is type(None) else type_name(option) for option in typing.get_args(hint))
    return str(hint).replace("typing.", "")


# ---------------------------------------------------------------------------------------------- typing
UnknownKey = Callable[[str, list, str], Exception]  # (dotted key, valid names, where) -> the error to raise


def _unknown_key(key: str, valid: list, where: str) -> ConfigError:
    return ConfigError(f"unknown key {key!r} ({where}); valid keys: {', '.join(valid)}")


_CONTAINERS = {list: (list, tuple), dict: dict}  # a container type and the YAML values of its kind


def _coerce(value: Any, hint: Any, key: str, unknown_key: UnknownKey | None) -> Any:
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
                return _coerce(value, option, key, unknown_key)
            except ConfigError as error:
                errors.append(str(error))
                if typing.get_origin(option) in _CONTAINERS and isinstance(value, _CONTAINERS[typing.get_origin(option)]):
                    raise  # the option of the value's kind: its own error names the item ([.inf, 1]: weights.0 is inf)
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
        return build_dataclass(hint, value, key + ".", unknown_key)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item, f"{key}.{i}", unknown_key) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {type(value).__name__} {value!r}")
        item = typing.get_args(hint)[1] if typing.get_args(hint) else Any  # checked as a list's items are
        return {k: _coerce(v, item, f"{key}.{k}", unknown_key) for k, v in value.items()}
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
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, type_name(hint))


def build_dataclass(cls: type, data: dict, prefix: str = "", unknown_key: UnknownKey | None = None) -> Any:
    """`cls` built from `data`, each value checked (and where lossless, converted) against its field's type;
    a key `cls` lacks raises `unknown_key(dotted key, the valid names, where)` (default: naming the valid names)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if not isinstance(key, str):  # `yes:`, `on:`, `1:` are a bool and an int to YAML 1.1
            raise ConfigError(f"config key {key!r} in [{prefix.rstrip('.') or 'top level'}] is not a name: YAML reads "
                              f"unquoted yes/no/on/off/true/false and numbers as values; quote it or fix the key")
        if key not in names:
            raise (unknown_key or _unknown_key)(f"{prefix}{key}", names, f"not a key of [{prefix.rstrip('.') or 'top level'}]")
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}", unknown_key) for name, value in data.items()}
    return cls(**kwargs)
