"""Vocabulary-parallel reductions of the logits that CE and NTL need.

Under tensor parallelism the LM head is split over the vocabulary: TP rank r holds the logit
columns `[shard.start, shard.start + V_local)` (a `VocabShard`, `shard.py`). CE and NTL need only three things from
the full `[n, V]` logits, and everything after them is small replicated math on every TP rank:

- the full-vocabulary log-sum-exp `lse[n]` (CE, and the number-token mass for reweighing),
- the logit of each row's target token `target[n]` (CE),
- the K number-token columns `number[n, K]` (NTL), whose ids may lie in any shard.

`reduce_shard_rows` computes all three with one all-reduce MAX of `n` floats and one all-reduce SUM
of `n * (K + 2)` floats over the TP group; `shard_reductions` wraps it in an autograd Function whose
backward writes the logit gradient once with no collective, and the chunked head (`chunked.py`) runs
it on each chunk. A TP group of size one (or None) runs no collective at all. Nothing here reads a
tensor value on the host (no device-to-host sync) except `VocabShard.check_tiling`, the layout check
that `check=True` runs (a trainer runs it once at start-up and then calls with `check=False`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.numbers import NumberVocab
from .shard import VocabShard, group_size


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower logits (bf16, fp16); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class NumberColumns:
    """Which number tokens a local logit shard holds, and in which of its columns."""

    local_cols: torch.Tensor  # [k_local] column of each owned number token in the local shard
    slots: torch.Tensor  # [k_local] its index k in the number vocabulary

    @classmethod
    def build(cls, number_vocab: NumberVocab, start: int, local_width: int, device: torch.device) -> "NumberColumns":
        """Worked out on the host from the vocabulary's ids and kept with it (no device sync, no copy per call)."""
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            slots = [k for k, token_id in enumerate(number_vocab.token_ids) if start <= token_id < start + local_width]
            cols = [number_vocab.token_ids[k] - start for k in slots]
            return (torch.tensor(cols, dtype=torch.long, device=device),
                    torch.tensor(slots, dtype=torch.long, device=device))

        key = ("shard_layout", start, local_width, torch.device(device))
        return cls(*number_vocab._cached(key, make))


SUM_EXP_BLOCK_ELEMENTS = 1 << 21  # 8 MiB of float32 temporaries: reused by the allocator, no page faults


def _sum_exp_by_blocks(logits: torch.Tensor, shift: torch.Tensor, out: torch.Tensor) -> None:
    """`out = sum(exp(logits - shift[:, None]), -1)`, a block of rows at a time so the temporary stays
    small (a full `[n, V]` temporary costs as much in fresh pages as the exp itself)."""
    rows = max(1, SUM_EXP_BLOCK_ELEMENTS // max(1, logits.shape[1]))
    for first in range(0, logits.shape[0], rows):
        block = torch.sub(logits[first:first + rows], shift[first:first + rows, None]).to(out.dtype)
        torch.sum(block.exp_(), dim=-1, out=out[first:first + rows])


def reduce_shard_rows(logits: torch.Tensor, columns: NumberColumns, num_numbers: int,
                      target_cols: torch.Tensor | None, target_owned: torch.Tensor | None,
                      tp_group: dist.ProcessGroup | None, *, need_lse: bool = True,
                      exp_in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-shard reduction of `[n, V_local]` logits to what CE and NTL need, replicated over the TP group.

    Returns `(shift [n], table [n, K + 2], probs)` in the compute dtype: the full-vocabulary log-sum-exp is
    `shift + log(table[:, 0])`, so softmax probabilities are `exp(z - shift) / table[:, 0]`, as precise as
    `torch.softmax`; `table[:, 1]` is the target logit (0 where `target_owned` is None), `table[:, 2:]` the K
    number-token logits. The shift is the row's largest logit over the whole vocabulary: a max is exact, so
    every TP layout (and one device) sees bitwise the same `exp(z - shift)` for each column.

    Collectives over `tp_group` (none for a group of one): with `need_lse`, one all-reduce MAX of the `n`
    local row maxima; then one all-reduce SUM of the packed table, each rank contributing its local
    `sum(exp(z - shift))`, the target logit where it owns the target and the number logits it owns (zeros
    elsewhere). Every rank gets identical results. No host sync.

    `exp_in_place`: the caller gives up `logits` (the chunked head's own chunk), which becomes
    `probs = exp(z - shift)` in the compute dtype, in place when already in it; otherwise the exp is summed a
    block at a time, `logits` is never modified and `probs` is None.
    """
    n, device = logits.shape[0], logits.device
    parallel = group_size(tp_group) > 1
    dtype = compute_dtype(logits.dtype)
    table = torch.zeros(n, num_numbers + 2, dtype=dtype, device=device)
    shift = torch.zeros(n, dtype=dtype, device=device)
    if need_lse:
        row_max = logits.amax(dim=-1).to(dtype)
        if parallel:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        # A row whose logits are all -inf would give nan; its sum_exp is 0 and its lse -inf.
        shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    if target_owned is not None:
        picked = logits.gather(1, target_cols.unsqueeze(1)).squeeze(1)
        table[:, 1] = torch.where(target_owned, picked.to(dtype), 0.0)
    if columns.local_cols.numel():
        table[:, 2 + columns.slots] = logits.index_select(1, columns.local_cols).to(dtype)
    probs = None
    if need_lse and exp_in_place:
        probs = (logits if logits.dtype == dtype else logits.to(dtype)).sub_(shift.unsqueeze(1))
        del logits  # a bf16/fp16 chunk's own logits are freed before the exp
        table[:, 0] = probs.exp_().sum(-1)
    elif need_lse:
        _sum_exp_by_blocks(logits, shift, out=table[:, 0])
    if parallel:
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=tp_group)
    return shift, table, probs


class _ShardReductions(torch.autograd.Function):
    """Reduce a local logit shard to (shift, sum_exp, target logit, number-token logits) over TP.

    Forward: `reduce_shard_rows` (with `need_lse`, one all-reduce MAX of `n` floats, then one all-reduce
    SUM of `n * (K + 2)` floats over the TP group). Every rank gets identical replicated results and
    computes the same loss from them. No host sync.

    Backward: NO collective. The loss is replicated over the TP group, so each rank's gradient for
    its own columns is complete: `exp(z - shift) * g_sum_exp` for the full-vocabulary part, plus
    `g_target` at the target column and `g_number[:, k]` at each owned number column, written into
    one `[n, V_local]` tensor (scatters, no data-dependent shapes). The gradient w.r.t. the hidden
    states is all-reduced by the parallel LM head's own backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_cols: torch.Tensor | None, target_owned: torch.Tensor | None,
                columns: NumberColumns, num_numbers: int, need_lse: bool, tp_group) -> tuple:
        shift, table, _ = reduce_shard_rows(logits, columns, num_numbers, target_cols, target_owned, tp_group,
                                            need_lse=need_lse)
        ctx.save_for_backward(logits, shift, target_cols if target_owned is not None else None, target_owned)
        ctx.columns = columns
        ctx.mark_non_differentiable(shift)
        return shift, table[:, 0].clone(), table[:, 1].clone(), table[:, 2:].clone()

    @staticmethod
    def backward(ctx, _grad_shift, grad_sum_exp, grad_target, grad_number):
        logits, shift, target_cols, target_owned = ctx.saved_tensors
        columns: NumberColumns = ctx.columns
        if grad_sum_exp is not None:
            # d sum_exp / d z = exp(z - shift), written once into the tensor that becomes the gradient
            grad = torch.sub(logits.to(shift.dtype), shift.unsqueeze(1)).exp_().mul_(grad_sum_exp.unsqueeze(1))
        else:
            grad = torch.zeros(logits.shape, dtype=shift.dtype, device=logits.device)
        if grad_target is not None and target_owned is not None:
            owned_grad = torch.where(target_owned, grad_target, 0.0).to(grad.dtype)
            grad.scatter_add_(1, target_cols.unsqueeze(1), owned_grad.unsqueeze(1))
        if grad_number is not None and columns.local_cols.numel():
            grad.index_add_(1, columns.local_cols, grad_number.index_select(1, columns.slots))
        return grad.to(logits.dtype), None, None, None, None, None, None


@dataclass
class ShardStats:
    """Replicated results of `shard_reductions` (identical on every rank of the TP group)."""

    shift: torch.Tensor | None  # [n] constant offset of the log-sum-exp (None when not requested)
    sum_exp: torch.Tensor | None  # [n] sum over the full vocabulary of exp(z - shift)
    target_logit: torch.Tensor | None  # [n] logit of the target token (None when not requested)
    number_logits: torch.Tensor  # [n, K] logits of the number tokens, float32 (float64 for float64 logits)

    @property
    def lse(self) -> torch.Tensor:
        """`[n]` full-vocabulary log-sum-exp."""
        return self.shift + self.sum_exp.log()

    def number_mass(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Probability mass (full-vocabulary softmax) on the number tokens at the given rows (default:
        every row, `[n]`)."""
        if rows is None:
            return torch.exp(self.number_logits - self.shift[:, None]).sum(-1) / self.sum_exp
        return torch.exp(self.number_logits[rows] - self.shift[rows, None]).sum(-1) / self.sum_exp[rows]


def shard_reductions(logits: torch.Tensor, number_vocab: NumberVocab, *, targets: torch.Tensor | None = None,
                     need_lse: bool = True, shard: VocabShard = VocabShard(), ignore_index: int = -100,
                     check: bool = True) -> ShardStats:
    """Full-vocabulary statistics of a local logit shard `[n, V_local]`, in float32 (float64 for
    float64 logits).

    Args:
        logits: the local vocabulary shard of the logits, `[n, V_local]`, any float dtype. Never
            modified.
        number_vocab: the number tokens whose columns are gathered.
        targets: `[n]` global token ids whose logits are wanted (ignore_index rows give 0), or None.
        need_lse: compute the full-vocabulary log-sum-exp (CE, reweigh).
        shard: where `logits` sit in the vocabulary (default: the whole vocabulary, one device).
        check: check the shard layout over the TP group first (`VocabShard.check_tiling`: one small
            all-reduce and a host read); False runs no host sync.
    """
    if logits.dim() != 2:
        raise ValueError(f"shard_reductions expects [n, V_local] logits, got shape {tuple(logits.shape)}")
    n, width = logits.shape
    shard.check_width(width, "the logits")
    if check:
        shard.check_tiling(logits.device, width)
    columns = NumberColumns.build(number_vocab, shard.start, width, logits.device)
    target_cols = target_owned = None
    if targets is not None:
        if targets.shape != (n,):
            raise ValueError(f"targets must have shape ({n},), got {tuple(targets.shape)}")
        target_cols, target_owned = shard.local_targets(targets, width, ignore_index)
    shift, sum_exp, target_logit, number_logits = _ShardReductions.apply(
        logits, target_cols, target_owned, columns, len(number_vocab), need_lse, shard.tp_group)
    return ShardStats(shift if need_lse else None, sum_exp if need_lse else None,
                      target_logit if targets is not None else None, number_logits)
