"""The tokenizer and the causal LM: load (continued pretraining) or build from a config (from scratch).

- The tokenizer comes from `tokenizer.name_or_path` (or the model's) and is checked against the model; for
  the self-contained demo a small digit-level byte-level BPE can be trained on the training corpus
  (`tokenizer.run`).
- The model comes from `from_pretrained` or `from_config`, in the training precision, with
  `flash_attention_2` when flash-attn imports and CUDA is present, else `sdpa` (the choice is logged).
- When the tokenizer has more tokens than the model, the embeddings are resized (on request) and the
  vocabulary padded to a multiple that the tensor-parallel size divides.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig, TokenizerConfig
from ..core.fs import local_or_hub
from ..tokenizer.loading import TokenizerLoadError, load_tokenizer
from ..tokenizer.run import check_tokenizer_matches_model, tokenizer_key, tokenizer_source

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------- tokenizer
def load_run_tokenizer(tokenizer_cfg: TokenizerConfig, model_cfg: ModelConfig) -> Any:
    """The run's tokenizer (a `transformers` fast tokenizer) with an EOS token for document packing, checked
    against the model it trains (`tokenizer.loading.load_tokenizer` loads any tokenizer source, unchecked).

    Accepts what `tools/tokenizer.py` accepts (a folder, a tokenizer.json, a SentencePiece .model
    file, a Hub id; folders saved by our tools load verbatim). With a pretrained model, a tokenizer
    far smaller than the model's vocabulary is refused here, before any weights are loaded.
    """
    source = tokenizer_source(tokenizer_cfg, model_cfg)
    key = tokenizer_key(tokenizer_cfg)
    try:
        tokenizer = load_tokenizer(local_or_hub(source, key), trust_remote_code=model_cfg.trust_remote_code)
    except TokenizerLoadError as error:
        raise ValueError(f"cannot load the tokenizer ({key}={source!r}): {error}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {source!r} has no EOS token, which packing puts between documents; "
                         f"add one (tokenizer.eos_token = ...) and save the tokenizer again")
    if model_cfg.name_or_path is not None:
        check_tokenizer_matches_model(len(tokenizer), int(load_model_config(model_cfg).vocab_size), source, key,
                                      model_cfg.name_or_path)
    return tokenizer


# ---------------------------------------------------------------------------------------------- model
def choose_attention(requested: str, document_rows: int = 0) -> str:
    """flash_attention_2 when flash-attn imports and CUDA is present, else sdpa (for "auto"). `document_rows`: the
    rows of a micro-batch when attention stays inside packed documents (data.document_mask), else 0; transformers
    separates documents for flash attention in a batch of one row only, so auto picks sdpa for more."""
    if requested != "auto":
        return requested
    if (torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
            and document_rows <= 1):
        return "flash_attention_2"
    return "sdpa"


def padded_vocab_size(size: int, pad_to_multiple_of: int, tp_size: int) -> int:
    """`size` rounded up to a multiple of lcm(pad_to_multiple_of, tp_size)."""
    multiple = math.lcm(pad_to_multiple_of, tp_size)
    return int(math.ceil(size / multiple) * multiple)


@dataclass
class ModelReport:
    """What building the model did, for the log and the run folder."""

    source: str  # hub id / folder, or "from_config:<model_type>"
    attn_implementation: str  # the attention backend in use
    dtype: str  # parameter dtype at load
    vocab_size: int  # the model's (possibly padded) vocabulary size
    tokenizer_size: int  # len(tokenizer)
    resized_from: int | None  # the vocabulary size before resizing, if resized
    parameters: int  # number of parameters


def _known_config_keys(config_class: type, config: Any) -> set[str]:
    """Every key a transformers config class takes: its constructor's arguments (and the common ones of
    PretrainedConfig), the attributes of an instance, and the aliases of its attribute_map."""
    from transformers import PretrainedConfig

    keys: set[str] = set(config.to_dict()) | set(getattr(config_class, "attribute_map", {}) or {})
    for cls in config_class.__mro__:
        if cls is object or not issubclass(cls, PretrainedConfig):
            continue
        keys |= {name for name, parameter in inspect.signature(cls.__init__).parameters.items()
                 if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and name != "self"}
    return {key for key in keys if not key.startswith("_")}


def _unknown_architecture_key(key: str, known: set[str], model_type: str) -> ValueError:
    import difflib

    nearest = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.0)
    hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
    return ValueError(f"model.architecture.{key} is not a key of the {model_type} config (transformers would keep it "
                      f"as an unused attribute and copy it into the exported config.json){hint}")


def _one_line(error: BaseException) -> str:
    """A library error's message on one line (huggingface_hub's validation errors span two)."""
    return " ".join(str(error).split()).rstrip(".")


def load_model_config(cfg: ModelConfig, local_files_only: bool = False) -> Any:
    """The transformers config of the run's model: `model.name_or_path`'s config.json with
    `model.architecture` over it, or a new one from `model.architecture`. Every architecture key must be
    one the config class knows (a misspelt key is refused with the nearest valid one).

    Raises ValueError naming the key or path and the fix; with `local_files_only`, a hub id that is not
    cached raises FileNotFoundError (the dry run then skips the checks that need it).
    """
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 configs: a value of the wrong type or
    from transformers import AutoConfig  # shape (vocab_size "60", hidden size not a multiple of the heads)

    if cfg.name_or_path is not None:
        name = cfg.name_or_path
        resolved = local_or_hub(name, "model.name_or_path")  # a clearly local path that is missing: said so
        if os.path.exists(resolved) and not os.path.isfile(os.path.join(resolved, "config.json")):
            raise ValueError(f"model.name_or_path={name!r} has no config.json: give a folder saved with "
                             f"save_pretrained (or tools/export_hf.py), or a hub id")
        try:
            config, unused = AutoConfig.from_pretrained(resolved, trust_remote_code=cfg.trust_remote_code,
                                                        local_files_only=local_files_only, return_unused_kwargs=True,
                                                        **cfg.architecture)
        except StrictDataclassError as error:
            raise ValueError(f"the model config of {name!r} (model.name_or_path) is refused by transformers: "
                             f"{_one_line(error)}; fix its config.json or override the key with model.architecture.KEY"
                             ) from None
        except (OSError, ValueError) as error:
            if local_files_only and not os.path.exists(resolved):
                raise FileNotFoundError(name) from None
            where = "" if os.path.exists(resolved) else " (not a local folder, so read as a hub id)"
            raise ValueError(f"cannot load the model config of {name!r}{where} (model.name_or_path): {error}") from None
        if unused:
            known = _known_config_keys(type(config), config)
            raise _unknown_architecture_key(sorted(unused)[0], known, config.model_type)
        return _check_vocab_size(config, f"the model config of {name!r} (model.name_or_path)")
    arch = dict(cfg.architecture)
    model_type = arch.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **arch)
    except StrictDataclassError as error:
        raise ValueError(f"model.architecture ({model_type}) is refused by transformers: {_one_line(error)}; fix "
                         f"that key") from None
    except ValueError as error:
        raise ValueError(f"model.architecture.model_type={model_type!r}: {error}") from None
    try:
        defaults = type(config)()
    except Exception:  # a composite config that needs arguments: its own attributes will do
        defaults = config
    known = _known_config_keys(type(config), defaults)
    stored = config.to_dict()
    for key in arch:
        # a key the constructor absorbed (a legacy name it converts) does not stay behind as an attribute
        if key not in known and key in stored:
            raise _unknown_architecture_key(key, known, model_type)
    return _check_vocab_size(config, "model.architecture")


def _check_vocab_size(config: Any, where: str) -> Any:
    """`config`, unless its vocab_size is below 1 (transformers accepts -1, then the build fails on a negative size)."""
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size < 1:
        raise ValueError(f"{where} has vocab_size={size}; set the model's vocabulary size (at least the tokenizer's "
                         f"length), e.g. model.architecture.vocab_size=N")
    return config


def max_positions(config: Any) -> int | None:
    """The longest sequence the model's position embeddings cover, if its config says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_sequence_length(config: Any, seq_len: int) -> None:
    """Refuse data.seq_len beyond the model's position embeddings (RoPE models would silently extrapolate,
    learned positions index out of range)."""
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(f"data.seq_len={seq_len} is longer than the model's max_position_embeddings={limit}; "
                         f"lower data.seq_len to <= {limit}, or raise model.architecture.max_position_embeddings "
                         f"(RoPE scaling) if you mean to train longer contexts")


def build_model(cfg: ModelConfig, tokenizer: Any, tp_size: int, ds_config: dict | None = None,
                document_rows: int = 0) -> tuple[torch.nn.Module, ModelReport]:
    """The causal LM on CPU, ready for `deepspeed.initialize`. Under ZeRO-3 (`model.partitioned_load`) a
    loaded model is built partitioned, each rank reading only its ZeRO share (T=1) or its AutoTP slices (T>1,
    read inside `deepspeed.initialize`) of the weights, and one built from scratch with T=1 is built
    partitioned with the whole build's weights (`models.loading`); otherwise every rank holds the full
    weights until `deepspeed.initialize` partitions them.

    Args:
        cfg: the model section.
        tokenizer: the run's tokenizer; a model built from scratch gets its (padded) vocabulary.
        tp_size: tensor-parallel size; the vocabulary of a new or resized model is padded so it divides.
        ds_config: the DeepSpeed config of the run (None: the full model on every rank).
        document_rows: rows of a micro-batch when attention stays inside documents, else 0 (`choose_attention`).
    """
    from transformers import AutoModelForCausalLM

    from . import families
    from . import loading as model_loading

    if tp_size > 1:  # before deepspeed.initialize shards the embedding (Gemma2's scaled embedding)
        families.accept_scaled_embeddings()
    attn = choose_attention(cfg.attn_implementation, document_rows)
    dtype = DTYPES[cfg.dtype]
    config = load_model_config(cfg)
    if tp_size > 1 and ds_config is not None:  # read by deepspeed.initialize's AutoTP
        families.add_tp_partition_config(ds_config, families.family_of(config)[0])
    tokenizer_size = len(tokenizer)
    # under ZeRO-3 a loaded model is built partitioned (T=1: ZeRO shares, T>1: AutoTP slices), one built from
    # scratch too at T=1 (same initial weights as the whole build)
    partitioned = cfg.partitioned_load and model_loading.partitioned_load_applies(ds_config, tp_size)
    resize = None
    if cfg.name_or_path is None:
        config.vocab_size = padded_vocab_size(tokenizer_size, cfg.pad_vocab_to_multiple_of, tp_size)
        if tokenizer.eos_token_id is not None:
            config.eos_token_id = tokenizer.eos_token_id
        torch.manual_seed(cfg.init_seed)  # the same initial weights on every rank
        if partitioned and tp_size == 1:  # the same weights as the whole build, each rank holding its share
            model = model_loading.build_from_config_partitioned(config, ds_config, attn_implementation=attn,
                                                                dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype,
                                                     trust_remote_code=cfg.trust_remote_code)
        source = f"from_config:{config.model_type}"
    elif partitioned:
        model, resize = model_loading.load_pretrained_partitioned(cfg, config, tokenizer, ds_config, tp_size,
                                                                  attn_implementation=attn, dtype=dtype)
        source = cfg.name_or_path
    else:
        model, loading = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path, config=config, attn_implementation=attn, dtype=dtype,
            trust_remote_code=cfg.trust_remote_code, output_loading_info=True)
        if loading.get("missing_keys"):  # transformers initialises them randomly and goes on (with a report)
            missing = sorted(loading["missing_keys"])
            hint = ("; if the checkpoint ties its head to the input embedding, set "
                    "model.architecture.tie_word_embeddings=true" if any("lm_head" in k for k in missing) else "")
            raise ValueError(f"model.name_or_path={cfg.name_or_path!r}: the checkpoint has no weights for "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, which would start from random "
                             f"values{hint}; else the files are incomplete (download them again)")
        source = cfg.name_or_path
    model_vocab = model_loading.full_shape(model.get_input_embeddings().weight)[0]
    resized_from = resize.old_rows if resize is not None else None
    if resize is not None:
        logger.info("%s", resize)
    if model_vocab < tokenizer_size:
        if not cfg.resize_embeddings:
            raise ValueError(
                f"the model's vocabulary ({model_vocab}) is smaller than the tokenizer's ({tokenizer_size} tokens): "
                f"token ids >= {model_vocab} have no embedding. Set model.resize_embeddings=true to resize it "
                f"(new rows get the mean embedding), or use the model's own tokenizer")
        from ..tokenizer.resize import resize_model_embeddings

        resized_from = model_vocab
        resize = resize_model_embeddings(model, tokenizer, math.lcm(cfg.pad_vocab_to_multiple_of, tp_size), init="mean")
        logger.info("%s", resize)
        model_vocab = resize.new_rows
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    report = ModelReport(source=source, attn_implementation=attn, dtype=cfg.dtype, vocab_size=int(model_vocab),
                         tokenizer_size=tokenizer_size, resized_from=resized_from,
                         parameters=sum(model_loading.full_numel(p) for p in model.parameters()))
    return model, report
