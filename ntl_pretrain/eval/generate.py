"""Distributed greedy generation for evaluation, safe under ZeRO-3 and AutoTP.

Three constraints shape the loop:

- ZeRO-3 gathers every layer's parameters collectively inside each forward pass, and AutoTP
  all-reduces activations over the tensor-parallel group, so every rank must run the same number
  of forward passes. Ranks agree once per step (one all-reduce over the world) on whether any rank
  still has work; a rank without work runs a 1-token "idle" forward so the others never wait.
- With a vocabulary-parallel LM head each tensor-parallel rank holds only its slice of the logits
  (its `VocabShard`, `ntl_pretrain.loss.vocab_shard_of`, as the loss takes it). The next token is the
  global argmax: the best local value and id on each rank, then MAX of the values and MIN of the ids
  that reach it over the TP group, so ties go to the lowest id exactly as `torch.argmax` does on the
  full vocabulary.
- Prompts are split over DATA-parallel ranks (contiguous chunks; all TP ranks of a data-parallel
  group hold the same chunk), batched by length, left-padded with attention masks and explicit
  position ids, decoded with a KV cache; finished rows leave the batch. Results are gathered so
  every rank returns the full list in the original order.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ntl_pretrain.loss.shard import VocabShard, vocab_shard_of

logger = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    """Continuations of every prompt (same on every rank) and what producing them cost."""

    texts: list[str]
    new_tokens: int
    forward_passes: int
    seconds: float
    truncated_prompts: int = 0  # prompts (all ranks) that kept only their last tokens to fit max_length

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens (all data-parallel ranks together) per second of wall time."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def unwrap_model(model_engine_or_module: Any) -> torch.nn.Module:
    """The HF module inside a DeepSpeed engine (or the module itself)."""
    return getattr(model_engine_or_module, "module", model_engine_or_module)


def data_parallel_group(model_engine_or_module: Any, dp_group: Any = None) -> Any:
    """The group prompts are split over: `dp_group`; else the AutoTP mesh's data-parallel group
    (`engine.mpu`); else the engine's `data_parallel_group`; else None (the world)."""
    if dp_group is not None:
        return dp_group
    mpu = getattr(model_engine_or_module, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return mpu.get_data_parallel_group()
    return getattr(model_engine_or_module, "data_parallel_group", None)


def _rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in `group` (None: the world) and the group's size; (0, 1) on one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def prompt_share(prompts: int, dp_rank: int, dp_size: int) -> range:
    """The indices of the prompts data-parallel rank `dp_rank` of `dp_size` generates: a contiguous chunk of
    ceil(prompts / dp_size) (the last ranks' shorter or empty); every tensor- and sequence-parallel peer of a rank
    the same chunk."""
    chunk = -(-prompts // dp_size)
    return range(dp_rank * chunk, min(prompts, (dp_rank + 1) * chunk))


def global_argmax(local_logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Ids of the largest logit per row over the whole vocabulary; ties go to the lowest id.

    Collectives (the shard's TP group, only when the vocabulary is split): all-reduce MAX of the best
    values, then all-reduce MIN of the ids that reach it.
    """
    logits = local_logits.float()
    best_value, best_local = logits.max(dim=-1)  # first (lowest) index on ties
    best_id = best_local + shard.start
    if not shard.is_split:
        return best_id
    global_value = best_value.clone()
    dist.all_reduce(global_value, op=dist.ReduceOp.MAX, group=shard.tp_group)
    no_claim = torch.iinfo(torch.long).max
    claimed = torch.where(best_value == global_value, best_id, torch.full_like(best_id, no_claim))
    dist.all_reduce(claimed, op=dist.ReduceOp.MIN, group=shard.tp_group)
    return claimed


def truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the earliest stop string, and whether one was found."""
    cut = min((index for index in (text.find(s) for s in stop if s) if index >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _any_rank_flag(flag: bool, device: torch.device) -> bool:
    """All-reduce (world, MAX) of a flag: True if it is set on any rank (e.g. still has prompts to finish)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _model_device(model_engine_or_module: Any) -> torch.device:
    device = getattr(model_engine_or_module, "device", None)
    if isinstance(device, torch.device):
        return device
    for parameter in unwrap_model(model_engine_or_module).parameters():
        return parameter.device
    return torch.device("cpu")


class _Batch:
    """The rows of one batch still being decoded, with their KV cache."""

    def __init__(self, indices: list[int], prompt_ids: list[list[int]], max_new: list[int], pad_id: int,
                 device: torch.device):
        width = max(len(ids) for ids in prompt_ids)
        self.indices = indices
        self.max_new = torch.tensor(max_new, dtype=torch.long)
        self.generated: list[list[int]] = [[] for _ in indices]
        self.active = list(range(len(indices)))  # positions in `indices` of rows still decoding
        ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        for row, prompt in enumerate(prompt_ids):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        self.next_input = ids.to(device)
        self.attention_mask = mask.to(device)
        # Left padding: positions count real tokens only, so a padded prompt sees the positions it would alone.
        self.position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0).to(device)
        self.cache: Any = None


def greedy_generate(model_engine_or_module: Any, tokenizer: Any, prompts: Sequence[str], *,
                    max_new_tokens: int | Sequence[int], stop: Sequence[str] | Sequence[Sequence[str]] = (),
                    batch_size: int = 16, max_length: int = 0, add_special_tokens: bool | None = None,
                    prefix_ids: Sequence[int] = (), dp_group: Any = None, tp_group: Any = None,
                    progress: Callable[[int, int, int], None] | None = None) -> GenerationOutput:
    """Greedy continuations of `prompts`, returned in order and identically on every rank.

    Every rank of the world must call this with the same arguments (it runs collectives).
    `max_new_tokens` and `stop` may be given per prompt. A row ends at the tokenizer's EOS, at a
    stop string (the text is cut before it, as lm-evaluation-harness does), or after its
    `max_new_tokens`. Prompts longer than `max_length - max_new_tokens` tokens (`max_length` 0:
    the model's `max_position_embeddings`) keep their last tokens, with a warning giving the numbers
    (as lm-evaluation-harness does); a `max_new_tokens` that leaves no room for a prompt is an error.
    `add_special_tokens` None: the tokenizer's own default (BOS for Llama-style tokenizers).
    `prefix_ids`: token ids put before every encoded prompt (e.g. the EOS that precedes every packed
    training document); they count toward the length limit.
    `dp_group`: the group prompts are split over (default: `data_parallel_group`). `tp_group`: the
    group of a vocabulary-parallel LM head (default: the head's own, `vocab_shard_of`).
    `progress`: called on this rank before the first step and after every decoding step with (this rank's
    batches done, its batch count, tokens it generated so far), e.g. `eval.progress.GenerationProgress`.
    """
    n = len(prompts)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    max_new = [int(max_new_tokens)] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(max_new) != n or any(m < 0 for m in max_new):
        raise ValueError(f"max_new_tokens must be an int >= 0 or one per prompt ({n}); got {max_new_tokens!r}")
    stops: list[tuple[str, ...]]
    if all(isinstance(s, str) for s in stop):
        stops = [tuple(stop)] * n  # type: ignore[arg-type]
    else:
        stops = [tuple(s) for s in stop]  # type: ignore[union-attr]
        if len(stops) != n:
            raise ValueError(f"stop has {len(stops)} lists of stop strings for {n} prompts; give one list per prompt")

    module = unwrap_model(model_engine_or_module)
    shard = vocab_shard_of(model_engine_or_module)
    if tp_group is not None:
        shard = replace(shard, tp_group=tp_group)
    dp_group = data_parallel_group(model_engine_or_module, dp_group)
    dp_rank, dp_size = _rank_and_size(dp_group)
    device = _model_device(model_engine_or_module)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id if eos_id is not None else 0)
    limit_source = "max_length"
    if max_length <= 0:
        max_length = int(getattr(module.config, "max_position_embeddings", 0) or 0)
        limit_source = "the model's max_position_embeddings"
    if max_length > 0 and max(max_new, default=0) >= max_length:
        raise ValueError(f"max_new_tokens={max(max_new)} leaves no room for the prompt within {max_length} tokens "
                         f"({limit_source}); lower max_new_tokens or raise max_length")
    special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    # transformers 5 renamed `past_key_values` to `cache`; `logits_to_keep` spares the [batch, length, V] logits.
    forward_parameters = inspect.signature(module.forward).parameters
    cache_kwarg = "cache" if "cache" in forward_parameters else "past_key_values"
    last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters else {}

    # This rank's contiguous chunk of prompts; longest first so batches hold similar lengths.
    mine = list(prompt_share(n, dp_rank, dp_size))
    encoded = {i: tokenizer(prompts[i], **special)["input_ids"] for i in mine}
    empty = [i for i in mine if not encoded[i]]
    encoded = {i: [*prefix_ids, *ids] for i, ids in encoded.items()}
    # Only this rank tokenized its chunk: agree on the error first, so every rank raises and none waits.
    if _any_rank_flag(bool(empty), device):
        detail = f"prompt {empty[0]} ({prompts[empty[0]]!r})" if empty else "a prompt on another rank"
        raise ValueError(f"{detail} encodes to no tokens; give non-empty prompts")
    truncated: dict[int, int] = {}  # prompt index -> its length before truncation
    for i in mine:
        keep = max_length - max_new[i]
        if max_length > 0 and len(encoded[i]) > keep:
            truncated[i] = len(encoded[i])
            encoded[i] = encoded[i][-keep:]
    if truncated:
        longest = max(truncated, key=lambda i: truncated[i])
        logger.warning("%d of this rank's %d prompts are longer than max_length (%d, %s) - max_new_tokens allows and keep only "
                       "their last tokens, so their start is lost (longest: prompt %d, %d tokens, kept %d). Raise "
                       "max_length (eval.max_length) or lower max_new_tokens, or use a model with more positions",
                       len(truncated), len(mine), max_length, limit_source, longest, truncated[longest],
                       max_length - max_new[longest])
    mine.sort(key=lambda i: (-len(encoded[i]), i))
    queue = [mine[start:start + batch_size] for start in range(0, len(mine), batch_size)]

    results: dict[int, tuple[str, int]] = {}
    total_batches, done_batches, finished_tokens = len(queue), 0, 0
    if progress is not None:
        progress(0, total_batches, 0)
    idle_input = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
    forward_passes = 0
    was_training = module.training
    module.eval()
    started = time.perf_counter()
    try:
        with torch.no_grad():
            batch: _Batch | None = None
            while True:
                if batch is None and queue:
                    indices = queue.pop(0)
                    batch = _Batch(indices, [encoded[i] for i in indices], [max_new[i] for i in indices],
                                   pad_id, device)
                if not _any_rank_flag(batch is not None, device):
                    break
                forward_passes += 1
                if batch is None:
                    module(input_ids=idle_input, use_cache=False)
                    continue
                outputs = module(input_ids=batch.next_input, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids, use_cache=True,
                                 **{cache_kwarg: batch.cache}, **last_logits_only)
                batch.cache = outputs.get(cache_kwarg)
                next_ids = global_argmax(outputs.logits[:, -1, :], shard)
                finished = _advance(batch, next_ids, tokenizer, eos_id, stops, results)
                batch_tokens = sum(len(generated) for generated in batch.generated)
                if finished:
                    done_batches, finished_tokens = done_batches + 1, finished_tokens + batch_tokens
                    batch = None
                if progress is not None:
                    progress(done_batches, total_batches, finished_tokens + (0 if finished else batch_tokens))
    finally:
        module.train(was_training)
    seconds = time.perf_counter() - started

    texts, new_tokens, seconds, truncated_count = _gather_results(results, len(truncated), n, seconds, dp_group, dp_size,
                                                                device)
    return GenerationOutput(texts=texts, new_tokens=new_tokens, forward_passes=forward_passes, seconds=seconds,
                            truncated_prompts=truncated_count)


def _advance(batch: _Batch, next_ids: torch.Tensor, tokenizer: Any, eos_id: int | None,
             stops: list[tuple[str, ...]], results: dict[int, tuple[str, int]]) -> bool:
    """Append the chosen tokens, retire finished rows, prepare the next step; True when the batch is done."""
    next_cpu = next_ids.cpu().tolist()
    keep: list[int] = []
    for slot, row in enumerate(batch.active):
        prompt_index = batch.indices[row]
        token = next_cpu[slot]
        finished = batch.max_new[row].item() == 0
        if not finished:
            if eos_id is not None and token == eos_id:
                finished = True
            else:
                batch.generated[row].append(token)
                finished = len(batch.generated[row]) >= batch.max_new[row].item()
        text = tokenizer.decode(batch.generated[row], skip_special_tokens=True)
        text, hit_stop = truncate_at_stop(text, stops[prompt_index])
        if finished or hit_stop:
            results[prompt_index] = (text, len(batch.generated[row]))
        else:
            keep.append(slot)
    if not keep:
        return True
    device = batch.next_input.device
    if len(keep) < len(batch.active):
        # Finished rows leave the batch (and the KV cache), so long answers do not drag short ones along.
        keep_index = torch.tensor(keep, dtype=torch.long, device=device)
        batch.cache.batch_select_indices(keep_index)
        batch.attention_mask = batch.attention_mask.index_select(0, keep_index)
        batch.position_ids = batch.position_ids.index_select(0, keep_index)
        next_ids = next_ids.index_select(0, keep_index)
        batch.active = [batch.active[slot] for slot in keep]
    batch.next_input = next_ids.view(-1, 1).to(device)
    ones = torch.ones((len(batch.active), 1), dtype=batch.attention_mask.dtype, device=device)
    batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
    batch.position_ids = batch.position_ids[:, -1:] + 1
    return False


def _gather_results(results: dict[int, tuple[str, int]], truncated: int, n: int, seconds: float, dp_group: Any,
                    dp_size: int, device: torch.device) -> tuple[list[str], int, float, int]:
    """Every prompt's text on every rank (all-gather over DP), total new tokens, slowest rank's time, and
    the number of truncated prompts over all data-parallel ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return [results[i][0] for i in range(n)], sum(count for _, count in results.values()), seconds, truncated
    gathered: list[Any] = [None] * dp_size
    dist.all_gather_object(gathered, (results, truncated), group=dp_group)
    merged: dict[int, tuple[str, int]] = {}
    for part, _ in gathered:
        merged.update(part)
    missing = [i for i in range(n) if i not in merged]
    if missing:
        raise RuntimeError(f"distributed generation lost prompts {missing[:10]}: the data-parallel group does not "
                           f"cover every chunk; pass the model's data-parallel group as dp_group")
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return ([merged[i][0] for i in range(n)], sum(count for _, count in merged.values()), float(slowest.item()),
            sum(count for _, count in gathered))
