"""Typed run configuration: dataclasses loaded from YAML, `key.sub=value` overrides, strict validation.

A run is described by one YAML file whose sections mirror the dataclasses below (`model`, `tokenizer`,
`data`, `loss`, `parallel`, `optim`, `train`, `checkpoint`, `monitor`, `deepspeed`, `eval`). Any key can
be overridden on the command line as `section.key=value` (values are parsed as YAML, so `true`, `3`,
`[0.9, 0.95]` and `null` work; list items are addressed by index: `data.sources.0.weight=2`).
Unknown keys are rejected with the nearest valid key named; values are type-checked.

The package: `schema` (the dataclasses and the choice types), `parsing` (keys, `--help`, types,
overrides), `validation` (cross-key and range checks); loading and saving are here.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import yaml

from .schema import (  # noqa: F401 (the package's API)
    AttnImplementation,
    CheckpointConfig,
    Config,
    ConfigError,
    DType,
    DataConfig,
    DataSourceConfig,
    DataStageConfig,
    DeepSpeedSection,
    LRScheduleName,
    LossConfig,
    MlflowConfig,
    ModelConfig,
    MonitorConfig,
    NTLScheduleName,
    NTLVariantName,
    OffloadDevice,
    OptimConfig,
    ParallelConfig,
    ProgressBar,
    ResumeLRSchedule,
    TokenizerConfig,
    TrainConfig,
    WandbConfig,
    WandbMode,
    ZeroStage,
)
from .parsing import (  # noqa: F401 (the package's API)
    SYNONYMS,
    get_key,
    help_text,
    iter_keys,
    parse_override,
)
from .validation import (  # noqa: F401 (the package's API)
    ntl_settings,
    validate,
)
from .parsing import _set_dotted, _validate_override_key, build, load_yaml

logger = logging.getLogger("ntl_pretrain")


# ---------------------------------------------------------------------------------------------- load/save
def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or start from defaults), apply `key=value` overrides, validate."""
    tree: dict = {}
    if path is not None:
        tree = _read_config_file(os.fspath(path))
    seen: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        if key in seen:  # wrappers put defaults first (the Slurm script's train.resume=auto): the last wins, said
            logger.warning("override %s is given twice on the command line (%r, then %r): the last wins",
                           key, seen[key], text)
        seen[key] = text
        _validate_override_key(key)
        _set_dotted(tree, key, value)
    config = build(Config, tree)
    validate(config)
    return config


def _read_config_file(path: str) -> dict:
    """The section mapping of a config file; every way a file can be unreadable is one line naming it."""
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a folder, not a file (pass --config configs/NAME.yaml)")
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist (pass --config configs/NAME.yaml)")
    if not os.path.isfile(path):  # /dev/zero, a FIFO: reading may never end
        raise ConfigError(f"config file {path!r} is not a regular file (pass --config configs/NAME.yaml)")
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as error:
        raise ConfigError(f"config file {path!r} cannot be read: {error.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte 0x{raw[error.start]:02x} on line {line}, "
                          f"e.g. latin-1): convert it, e.g. iconv -f latin1 -t utf-8") from None
    try:
        tree = load_yaml(text, path)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path!r} is not valid YAML: {' '.join(str(error).split())}") from None
    if tree is None:  # empty, or comments only: running on the defaults was not what was meant
        raise ConfigError(f"config file {path!r} holds no settings (it is empty or all comments); start from "
                          f"configs/demo.yaml, or leave out --config to use the defaults and overrides only")
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(tree).__name__}")
    return tree


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)


def write_resolved(config: Config, directory: str, filename: str = "config.yaml") -> str:
    """Write the resolved configuration into the run folder (atomically)."""
    from ..core.fs import write_text_atomic

    return write_text_atomic(os.path.join(directory, filename), to_yaml(config))
