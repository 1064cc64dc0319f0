"""Resize a model's input and output embeddings after its tokenizer gained tokens.

The rows are resized with transformers' own `resize_token_embeddings` (which handles tied and
untied heads, the head's bias and `config.vocab_size`); this module then initialises the new rows.
Call it on the full model, before `deepspeed.initialize` partitions it (as the trainer does).

- a new bare digit "7" gets the embedding of the same digit under another spelling that the model
  already learned ("Ġ7" in byte-level BPE, "▁7" in SentencePiece, "##7", "7</w>"), when one exists;
- every other new row, padding rows included, gets the mean of the rows of the tokenizer's
  existing tokens (a padded model's spare rows were never trained and are left out). A mean row keeps
  the output distribution close to the old one (its logit is about the average logit), unlike a
  random row.

The total row count is padded to a multiple of `pad_to_multiple_of`, so that a tensor-parallel size
dividing that multiple splits the vocabulary evenly. Rows are never removed.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch
from torch import nn

from ntl_pretrain.core.numbers import DIGITS, NumberVocab

DIGIT_SPELLINGS = ("Ġ{}", "▁{}", " {}", "##{}", "{}</w>")
INIT_METHODS = ("mean", "model")
REPORT_FILENAME = "resize_report.json"


@dataclass
class ResizeReport:
    """What `resize_model_embeddings` changed."""

    old_rows: int
    new_rows: int
    tokenizer_size: int
    pad_to_multiple_of: int
    init: str
    tied: bool
    new_token_ids: list[int] = field(default_factory=list)
    copied_from: dict[str, str] = field(default_factory=dict)
    mean_token_rows: int = 0
    padding_rows: int = 0
    tokenizer_note: str = ""
    """`resize-model`: how the saved folder loads when a tool other than ours reads it (empty: as saved)."""

    def __str__(self) -> str:
        return self.format()

    @property
    def changed(self) -> bool:
        return self.new_rows != self.old_rows or bool(self.new_token_ids)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["changed"] = self.changed
        return data

    def format(self) -> str:
        note = [f"  note: {self.tokenizer_note}"] if self.tokenizer_note else []
        if not self.changed:
            return "\n".join([f"embeddings unchanged: {self.old_rows} rows already hold the tokenizer's "
                              f"{self.tokenizer_size} tokens and are a multiple of {self.pad_to_multiple_of}"] + note)
        lines = [f"embeddings resized {self.old_rows} -> {self.new_rows} rows (tokenizer: {self.tokenizer_size} "
                 f"tokens, multiple of {self.pad_to_multiple_of}; {'tied' if self.tied else 'untied'} output head)"]
        if self.copied_from:
            lines.append("  digit rows copied from another spelling: "
                         + ", ".join(f"{new!r} <- {old!r}" for new, old in self.copied_from.items()))
        if self.init == "mean":
            lines.append(f"  rows set to the mean of the existing rows: {self.mean_token_rows} new tokens, "
                         f"{self.padding_rows} padding rows")
        else:
            lines.append(f"  new rows keep the model's own initialisation ({len(self.new_token_ids)} new tokens, "
                         f"{self.padding_rows} padding rows)")
        return "\n".join(lines + note)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _digit_sources(tokenizer, token_ids: Iterable[int], usable) -> dict[int, int]:
    """For each new bare-digit token, the id of the same digit spelled another way that has a trained row."""
    vocab = tokenizer.get_vocab()
    sources = {}
    for token_id in token_ids:
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token not in DIGITS:
            continue
        for spelling in DIGIT_SPELLINGS:
            source = vocab.get(spelling.format(token))
            if source is not None and usable(source):
                sources[token_id] = source
                break
    return sources


@dataclass
class RowPlan:
    """Which rows a vocabulary resize adds and how "mean" initialises them (shared by the in-memory resize
    and the partitioned ZeRO-3 load, `models.loading`)."""

    old_rows: int
    new_rows: int
    tokenizer_size: int
    pad_to_multiple_of: int
    new_ids: list[int]  # new tokens' rows (appended, or inside the old rows)
    padding: list[int]  # rows past the tokenizer's last token
    copy_from: dict[int, int]  # new bare digit row -> the row of another spelling of it
    mean_rows: list[int]  # rows set to the mean of the trained rows
    trained: list[int]  # the rows of the tokenizer's existing tokens (the mean's rows)

    def check_mean(self) -> None:
        if not self.trained:
            raise ValueError("every existing embedding row belongs to a new token; there is no trained row to average")

    def report(self, init: str, tied: bool, tokenizer) -> ResizeReport:
        report = ResizeReport(old_rows=self.old_rows, new_rows=self.new_rows, tokenizer_size=self.tokenizer_size,
                              pad_to_multiple_of=self.pad_to_multiple_of, init=init, tied=tied,
                              new_token_ids=list(self.new_ids), padding_rows=len(self.padding))
        if init == "mean":
            report.copied_from = {tokenizer.convert_ids_to_tokens(t): tokenizer.convert_ids_to_tokens(s)
                                  for t, s in self.copy_from.items()}
            report.mean_token_rows = len(self.new_ids) - len(self.copy_from)
        return report


def check_pad_to_multiple_of(pad_to_multiple_of: int) -> None:
    """Refuse a row multiple that is not a positive integer (before a model is loaded to be resized)."""
    if not isinstance(pad_to_multiple_of, int) or isinstance(pad_to_multiple_of, bool) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r} must be a positive integer (e.g. 64, or a "
                         f"multiple of the tensor-parallel size)")


def plan_new_rows(tokenizer, old_rows: int, pad_to_multiple_of: int,
                  new_token_ids: Iterable[int] | None = None) -> RowPlan:
    """The rows that growing `old_rows` embedding rows to hold `tokenizer` adds (see `resize_model_embeddings`)."""
    check_pad_to_multiple_of(pad_to_multiple_of)
    tokenizer_size = len(tokenizer)
    target_rows = _round_up(max(old_rows, tokenizer_size), pad_to_multiple_of)
    inside = sorted(set(int(i) for i in (new_token_ids or ())))
    bad = [i for i in inside if not 0 <= i < tokenizer_size]
    if bad:
        raise ValueError(f"new_token_ids {bad} are not ids of the tokenizer's {tokenizer_size} tokens")
    new_ids = sorted(set(inside) | set(range(old_rows, min(target_rows, tokenizer_size))))
    padding = list(range(max(old_rows, tokenizer_size), target_rows))
    new_id_set = set(new_ids)
    # rows of the tokenizer's existing tokens; a padded model's spare rows were never trained
    trained = [i for i in range(min(old_rows, tokenizer_size)) if i not in new_id_set]
    sources = _digit_sources(tokenizer, new_ids, lambda i: i < old_rows and i not in new_id_set)
    return RowPlan(old_rows=old_rows, new_rows=target_rows, tokenizer_size=tokenizer_size,
                   pad_to_multiple_of=pad_to_multiple_of, new_ids=new_ids, padding=padding, copy_from=sources,
                   mean_rows=[i for i in new_ids if i not in sources] + padding, trained=trained)


def resize_model_embeddings(model: nn.Module, tokenizer, pad_to_multiple_of: int, init: str = "mean",
                            new_token_ids: Iterable[int] | None = None) -> ResizeReport:
    """Grow the model's embeddings to hold every tokenizer token, padded to `pad_to_multiple_of` rows.

    Args:
        model: a `transformers` PreTrainedModel (causal LM), tied or untied head.
        tokenizer: the tokenizer the model will be trained with (`len(tokenizer)` tokens).
        pad_to_multiple_of: total rows become a multiple of this (e.g. 64 * tensor-parallel size).
        init: "mean" (new rows = mean of the existing tokens' rows, new digits copy another
            spelling's row) or "model" (appended rows keep the model's own random initialisation).
        new_token_ids: ids of tokens added to the tokenizer that fall INSIDE the existing rows (a model
            whose vocabulary was already padded); with init="mean" their rows are re-initialised too.
            Ids at or above the old row count are always treated as new.
    """
    if init not in INIT_METHODS:
        raise ValueError(f"init={init!r} is not supported; use one of {INIT_METHODS}")
    input_embeddings = model.get_input_embeddings()
    if not isinstance(input_embeddings, nn.Embedding):
        raise TypeError(f"the model's input embeddings are {type(input_embeddings).__name__}, not nn.Embedding")
    output_embeddings = model.get_output_embeddings()
    params = [input_embeddings.weight] + ([output_embeddings.weight] if output_embeddings is not None else [])
    if any(hasattr(p, "ds_id") for p in params):
        raise RuntimeError("the embeddings are already partitioned by DeepSpeed ZeRO-3: resize the full model before "
                           "deepspeed.initialize (and outside deepspeed.zero.Init), then hand it to DeepSpeed")
    old_rows = int(input_embeddings.weight.shape[0])
    plan = plan_new_rows(tokenizer, old_rows, pad_to_multiple_of, new_token_ids)
    tied = output_embeddings is not None and output_embeddings.weight is input_embeddings.weight
    report = plan.report(init, tied, tokenizer)
    if not report.changed:
        return report
    if plan.new_rows != old_rows:
        model.resize_token_embeddings(plan.new_rows, mean_resizing=False)
    if init != "mean":
        return report
    plan.check_mean()
    mean_rows = torch.tensor(plan.mean_rows, dtype=torch.long)
    copy_to = torch.tensor(list(plan.copy_from), dtype=torch.long)
    copy_from = torch.tensor(list(plan.copy_from.values()), dtype=torch.long)
    trained_rows = torch.tensor(plan.trained, dtype=torch.long)

    def initialise(tensor: torch.Tensor) -> None:
        data = tensor.data
        mean = data[trained_rows.to(data.device)].float().mean(dim=0).to(data.dtype)
        if len(mean_rows):
            data[mean_rows.to(data.device)] = mean
        if len(copy_to):
            data[copy_to.to(data.device)] = data[copy_from.to(data.device)]

    input_embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings()
    with torch.no_grad():
        initialise(input_embeddings.weight)
        if output_embeddings is not None and output_embeddings.weight is not input_embeddings.weight:
            initialise(output_embeddings.weight)
        bias = getattr(output_embeddings, "bias", None) if output_embeddings is not None else None
        if isinstance(bias, torch.Tensor):
            initialise(bias)
    report.tied = output_embeddings is not None and output_embeddings.weight is input_embeddings.weight
    return report


def _pipeline(tokenizer) -> dict:
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    return {key: data.get(key) for key in ("normalizer", "pre_tokenizer", "model", "decoder", "post_processor")}


def _check_saved_tokenizer(tokenizer, folder, trust_remote_code: bool) -> str:
    """Check that our loader reads the saved folder back as `tokenizer`; say so when AutoTokenizer does not.

    With a config.json of some model types beside it (`qwen2`, `phi3`, ...), transformers 5's
    AutoTokenizer builds the family's own class whatever tokenizer_config.json names, and that class
    rebuilds its pipeline from the vocabulary (Qwen2Tokenizer: NFC and Qwen's regex, no digit split).
    """
    from transformers import AutoTokenizer

    from ntl_pretrain.tokenizer.loading import load_tokenizer

    expected = _pipeline(tokenizer)
    if _pipeline(load_tokenizer(folder)) != expected:
        raise RuntimeError(f"the tokenizer saved into {str(folder)!r} does not load back as the given tokenizer")
    auto = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    if _pipeline(auto) == expected:
        return ""
    return (f"AutoTokenizer.from_pretrained(OUT) builds {type(auto).__name__} here (transformers chooses it from "
            f"config.json's model_type), which rebuilds its own pipeline and loses this tokenizer's (e.g. its digit "
            f"split). The trainer and tools/tokenizer.py load OUT as saved; elsewhere load it with "
            f"PreTrainedTokenizerFast.from_pretrained(OUT)")


def resize_model(model_path: str | os.PathLike, tokenizer_path: str | os.PathLike, out_dir: str | os.PathLike,
                 pad_to_multiple_of: int, init: str = "mean", force: bool = False,
                 trust_remote_code: bool = False) -> tuple[ResizeReport, str | None]:
    """Load a model and a tokenizer, resize the embeddings, and save both to `out_dir`.

    Also writes `number_vocab.json` (sized to the new rows) when the tokenizer has the ten digit
    tokens, and `resize_report.json`. Returns the report and the number vocabulary's path (or None).
    """
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.tokenizer.loading import atomic_output_dir, check_output_dir, load_tokenizer, save_verbatim

    check_pad_to_multiple_of(pad_to_multiple_of)  # the arguments first: the model may take minutes to load
    if init not in INIT_METHODS:
        raise ValueError(f"init={init!r} is not supported; use one of {INIT_METHODS}")
    check_output_dir(out_dir, force, sources=(model_path, tokenizer_path))
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype="auto",
                                                     trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load a causal LM from {str(model_path)!r}: {error}") from None
    report = resize_model_embeddings(model, tokenizer, pad_to_multiple_of, init=init)
    vocab = tokenizer.get_vocab()
    number_vocab = (NumberVocab.from_tokenizer(tokenizer, vocab_size=report.new_rows)
                    if all(d in vocab for d in DIGITS) else None)
    with atomic_output_dir(out_dir, force) as staging:
        model.save_pretrained(str(staging))
        save_verbatim(tokenizer, staging)  # as split-digits saves: tokenizer.json is loaded as it is
        report.tokenizer_note = _check_saved_tokenizer(tokenizer, staging, trust_remote_code)
        if number_vocab is not None:
            number_vocab.save(staging)
        (staging / REPORT_FILENAME).write_text(json.dumps(report.to_dict(), indent=1) + "\n", encoding="utf-8")
    return report, (os.path.join(str(out_dir), "number_vocab.json") if number_vocab is not None else None)
