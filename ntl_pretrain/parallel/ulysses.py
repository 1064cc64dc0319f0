"""Ulysses sequence parallelism: DeepSpeed's attention for Hugging Face models, and each rank's slice of a
packed micro-batch.

The `sp` ranks of a sequence-parallel group hold the same packed rows `[B, S]`; each runs the model on its
slice of `S / sp` positions (`SequenceShard`). DeepSpeed's `UlyssesSPAttentionHF` (deepspeed 0.19.8,
`runtime/sequence_parallel/ulysses_sp.py`), registered in place of the model's sdpa/flash attention, trades
the sequence slices for head slices with one all-to-all before attention and one after, so attention sees the
whole sequence for `heads / sp` heads. It drops the attention mask and needs the GLOBAL position ids of the
slice: gathered over the group, they must read as the unsharded model's (0..S-1 per row, or per document with
`data.document_mask`, `model_inputs`); flash attention runs packed documents from them, sdpa gets their
block-causal mask here (`document_masked_attention`).

DeepSpeed builds its groups itself (`parallel_state_sp.initialize_sequence_parallel`, once per process):
sequence-parallel groups of `sp` CONSECUTIVE ranks, so global rank g has sp rank g % sp and data-parallel rank
g // sp; ZeRO-3 partitions the weights over all `sp x dp` ranks (the "sequence data parallel" group) and divides
the summed gradients by `sp x dp` (`check_deepspeed_config`; docs/training.md, "Long context").

The loss of a slice is `loss/sequence_shard.py`'s. Generation runs the plain attention on whole prompts
(`UlyssesAttention.unsharded`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..config import ConfigError
from ..data.documents import document_position_ids
from ..loss.sequence_shard import SequenceShard

ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def check_sequence_split(sp_size: int, seq_len: int | None = None, attention_heads: int | None = None,
                         kv_heads: int | None = None) -> None:
    """Raise (ConfigError) naming the keys when `sp_size` cannot split this sequence or these heads: Ulysses
    needs `seq_len % sp == 0`, `heads % sp == 0`, and kv heads a multiple or a divisor of sp (DeepSpeed
    replicates kv heads when sp exceeds them)."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ConfigError(f"parallel.sp_size must be a positive integer, got {sp_size!r}")
    if sp_size == 1:
        return
    if seq_len is not None and seq_len % sp_size:
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by parallel.sp_size={sp_size}: set data.seq_len "
                          f"to a multiple of {sp_size} (e.g. {seq_len - seq_len % sp_size or sp_size})")
    if attention_heads is not None and attention_heads % sp_size:
        raise ConfigError(f"the model's num_attention_heads={attention_heads} is not divisible by "
                          f"parallel.sp_size={sp_size} (Ulysses gives each rank heads / sp_size heads): choose a "
                          f"parallel.sp_size that divides {attention_heads}")
    if kv_heads is not None and kv_heads % sp_size and sp_size % kv_heads:
        raise ConfigError(f"the model's num_key_value_heads={kv_heads} and parallel.sp_size={sp_size} do not "
                          f"divide one another (Ulysses splits or replicates kv heads): choose a parallel.sp_size "
                          f"that divides or is a multiple of {kv_heads}")


def check_deepspeed_config(ds_config: dict, sp_size: int) -> None:
    """Raise (ConfigError) when the DeepSpeed config averages gradients in a way the trainer does not undo
    under sequence parallelism.

    DeepSpeed 0.19.8 sums each gradient over all dp x sp ranks, then divides differently by path: ZeRO-3 with
    `reduce_scatter` (its default) by dp x sp (`reduce_scatter_coalesced` over the partition group);
    ZeRO-3 without it and ZeRO 0-2 by dp = (dp x sp) / sp (`__avg_scatter_contiguous_grads`, `allreduce_bucket`).
    The trainer multiplies back by dp x sp (`ParallelLayout.grad_average_size`), measured against plain
    transformers in tests/test_sequence_parallel.py, so only the first path is accepted."""
    if sp_size == 1:
        return
    zero = ds_config.get("zero_optimization", {})
    if zero.get("stage", 0) != 3:
        raise ConfigError(f"parallel.sp_size={sp_size} runs with ZeRO-3 only (parallel.zero_stage="
                          f"{zero.get('stage', 0)}): DeepSpeed 0.19.8 divides the gradients of stages 0-2 by dp, not "
                          f"dp x sp as under ZeRO-3; set parallel.zero_stage=3")
    if zero.get("reduce_scatter", True) is False:
        raise ConfigError(f"parallel.sp_size={sp_size} needs zero_optimization.reduce_scatter (DeepSpeed's default): "
                          f"without it DeepSpeed 0.19.8 divides the gradients by dp, not dp x sp; remove "
                          f"reduce_scatter: false from the DeepSpeed JSON (deepspeed.config)")


@dataclass
class UlyssesAttention:
    """DeepSpeed's Ulysses attention registered for a model (`register_ulysses_attention`): its groups and the way
    back to the plain attention for generation."""

    mpu: Any  # DeepSpeed's `parallel_state_sp` module: pass as `deepspeed.initialize(mpu=...)`
    shard: SequenceShard  # this rank's slice of every sequence
    implementation: str  # the transformers attention key the Ulysses wrapper replaced ("sdpa", ...)
    plain: Callable  # the attention function it replaced

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """Inside: the model's own attention on each rank's whole input (generation: prompts are not split, and
        DeepSpeed's wrapper drops the attention mask, which left-padded batches need, even with its
        `disable_in_eval`). The Ulysses wrapper is back on exit."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        wrapper = ALL_ATTENTION_FUNCTIONS[self.implementation]
        ALL_ATTENTION_FUNCTIONS[self.implementation] = self.plain
        try:
            yield
        finally:
            ALL_ATTENTION_FUNCTIONS[self.implementation] = wrapper


_registered: list[UlyssesAttention] = []  # the registration in force in this process (at most one)


def release_ulysses_attention() -> None:
    """Undo `register_ulysses_attention` in this process, if any (the model's own attention back in transformers'
    table, DeepSpeed's sequence-parallel groups forgotten): an engine without sequence parallelism built after
    one with it (tests, tools) must not run through the Ulysses wrapper. No collective."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    while _registered:
        previous = _registered.pop()
        ALL_ATTENTION_FUNCTIONS[previous.implementation] = previous.plain
        parallel_state_sp._release_sequence_parallel_groups()


def register_ulysses_attention(model: Any, sp_size: int, micro_batch_size: int,
                               document_mask: bool = False) -> UlyssesAttention:
    """Put DeepSpeed's Ulysses attention in place of `model`'s attention backend (process-wide: transformers'
    attention table) and create DeepSpeed's sequence-parallel groups (a collective: every rank calls it), before
    `deepspeed.initialize` (pass it the returned `mpu`). A second call (another engine in the same process)
    first undoes the previous one: DeepSpeed keeps one set of groups per process and bakes the micro batch in.

    `document_mask` (data.document_mask): the inputs carry per-document position ids (`model_inputs`); flash
    attention reads the gathered ones itself (variable-length sequences), sdpa gets the whole rows' block-causal
    mask from them (`document_masked_attention`); DeepSpeed rebuilds flex attention's mask plainly causal, so
    flex is refused."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    release_ulysses_attention()

    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in ULYSSES_ATTENTION:
        raise ValueError(f"parallel.sp_size={sp_size} needs the model's attention to be one of "
                         f"{', '.join(ULYSSES_ATTENTION)} (DeepSpeed's Ulysses wraps it), got {attention!r}: set "
                         f"model.attn_implementation=sdpa")
    text = model.config.get_text_config()
    check_sequence_split(sp_size, None, text.num_attention_heads,
                         getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    if document_mask and attention == "flex_attention":
        raise ValueError(f"parallel.sp_size={sp_size} with data.document_mask=true needs sdpa or flash attention "
                         f"(DeepSpeed's Ulysses rebuilds flex attention's mask plainly causal, across documents): set "
                         f"model.attn_implementation=sdpa")
    plain = ALL_ATTENTION_FUNCTIONS[attention]
    if document_mask and not attention.startswith("flash_attention"):
        # DeepSpeed wraps the function it finds in the table: the masked one, for the core attention
        ALL_ATTENTION_FUNCTIONS[attention] = document_masked_attention(plain)
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=sp_size,
            micro_batch_size=micro_batch_size, seq_length_is_variable=True)
    except BaseException:
        ALL_ATTENTION_FUNCTIONS[attention] = plain
        raise
    _registered.append(UlyssesAttention(mpu=mpu, shard=sequence_shard(mpu), implementation=attention, plain=plain))
    return _registered[-1]


def sequence_shard(mpu: Any | None) -> SequenceShard:
    """This rank's `SequenceShard` from DeepSpeed's sequence-parallel groups (`register_ulysses_attention`'s
    mpu); None: no sequence parallelism."""
    if mpu is None:
        return SequenceShard()
    return SequenceShard(rank=mpu.get_sequence_parallel_rank(), size=mpu.get_sequence_parallel_world_size(),
                         group=mpu.get_sequence_parallel_group())


@dataclass
class ShardInputs:
    """What one rank's forward of a sequence-sharded micro-batch takes."""

    input_ids: torch.Tensor  # [B, S / sp] this rank's slice
    position_ids: torch.Tensor  # [B, S / sp] the slice of the whole rows' position ids (global, not from 0)

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}


def shard_inputs(input_ids: torch.Tensor, shard: SequenceShard, position_ids: torch.Tensor | None = None) -> ShardInputs:
    """This rank's slice of the packed `[B, S]` rows and of their position ids: `position_ids` `[B, S]` of the
    whole rows (per document: `data.documents.document_position_ids`), None: the unsharded model's default
    `arange(S)`. The labels stay whole: the loss slices them itself (`loss/sequence_shard.py`), since number
    spans are found on whole rows."""
    if position_ids is None:
        start, stop = shard.bounds(input_ids.shape[1])
        positions = torch.arange(start, stop, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
    else:
        positions = shard.split(position_ids)
    return ShardInputs(input_ids=shard.split(input_ids), position_ids=positions)


def model_inputs(input_ids: torch.Tensor, shard: SequenceShard, document_eos_id: int | None) -> dict[str, Any]:
    """The model's keyword arguments for a micro-batch of packed rows `[B, S]` on this rank (its slice under
    sequence parallelism). With `document_eos_id` (data.document_mask) the position ids restart after each EOS and
    attention stays inside each document: transformers builds the block-causal mask from such position ids when
    there is neither an attention mask nor a cache (hence `use_cache=False`: a cache would hide them), and runs
    flash attention as variable-length sequences; under Ulysses the attention after the all-to-all gets the
    gathered position ids (`register_ulysses_attention`). None: positions 0..S-1, attention over the whole row."""
    positions = None if document_eos_id is None else document_position_ids(input_ids, document_eos_id)
    if shard.size > 1:
        inputs: dict[str, Any] = shard_inputs(input_ids, shard, positions).as_kwargs()
    elif positions is None:
        return {"input_ids": input_ids}
    else:
        inputs = {"input_ids": input_ids, "position_ids": positions}
    if positions is not None:
        inputs["use_cache"] = False
    return inputs


def document_block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """`[B, 1, S, S]` boolean mask (True: may attend) of whole packed rows from their per-document position ids
    `[B, S]`: causal, and never across a document (a new document where the positions do not go up by one, as
    transformers' `find_packed_sequence_indices`, which is not called: its check for unpacked rows reads the
    device, a host sync in every attention layer). Built once per layer call, since DeepSpeed gathers the positions
    per layer: O(B S^2) booleans, small beside the attention's O(B H S^2 D)."""
    steps = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    document = (steps != 1).cumsum(dim=-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (document.unsqueeze(-1) == document.unsqueeze(-2))).unsqueeze(1)


def document_masked_attention(attention: Callable) -> Callable:
    """`attention` (transformers' sdpa) given the block-causal mask of the whole rows when it is called without a
    mask but with their position ids: what DeepSpeed's Ulysses wrapper does after its all-to-all (it drops the
    slice's mask and passes the gathered position ids, which only flash attention reads)."""

    def masked(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               *args: Any, **kwargs: Any) -> Any:
        positions = kwargs.get("position_ids")
        if attention_mask is None and positions is not None and query.shape[2] == positions.shape[-1] > 1:
            attention_mask = document_block_causal_mask(positions)
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    return masked
