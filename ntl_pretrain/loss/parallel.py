"""Vocabulary-parallel reductions of the logits that CE and NTL need.

Under tensor parallelism the LM head is split over the vocabulary: TP rank r holds the logit
columns `[vocab_start_index, vocab_start_index + V_local)`. CE and NTL need only three things from
the full `[n, V]` logits, and everything after them is small replicated math on every TP rank:

- the full-vocabulary log-sum-exp `lse[n]` (CE, and the number-token mass for reweighing),
- the logit of each row's target token `target[n]` (CE),
- the K number-token columns `number[n, K]` (NTL), whose ids may lie in any shard.

`shard_reductions` computes all three with one all-reduce MAX of `n` floats and one all-reduce SUM
of `n * (K + 2)` floats over the TP group, and a backward that writes the logit gradient once with no
collective. A TP group of size one (or None) runs no collective at all. Nothing here reads a tensor
value on the host (no device-to-host sync) except `check_shard_layout`, the layout check that
`check=True` runs (a trainer runs it once at start-up and then calls with `check=False`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..numbers import NumberVocab


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower logits (bf16, fp16); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of `group`; 1 for None or when torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


@dataclass(frozen=True)
class ShardLayout:
    """Where the local logit shard sits in the vocabulary, and which number columns it owns."""

    vocab_start_index: int
    local_width: int
    local_number_cols: torch.Tensor  # [k_local] column of each owned number token in the local shard
    owned_number_slots: torch.Tensor  # [k_local] its index k in the number vocabulary

    @classmethod
    def build(cls, number_vocab: NumberVocab, vocab_start_index: int, local_width: int,
              device: torch.device) -> "ShardLayout":
        """Worked out on the host from the vocabulary's ids and kept with it (no device sync, no copy per call)."""
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            slots = [k for k, token_id in enumerate(number_vocab.token_ids)
                     if vocab_start_index <= token_id < vocab_start_index + local_width]
            cols = [number_vocab.token_ids[k] - vocab_start_index for k in slots]
            return (torch.tensor(cols, dtype=torch.long, device=device),
                    torch.tensor(slots, dtype=torch.long, device=device))

        key = ("shard_layout", vocab_start_index, local_width, torch.device(device))
        cols, slots = number_vocab._cached(key, make)
        return cls(vocab_start_index, local_width, cols, slots)


def check_shard_layout(local_width: int, vocab_start_index: int, tp_group: dist.ProcessGroup | None,
                       device: torch.device | str = "cpu") -> int:
    """Check that the vocabulary shards of the TP group tile `[0, V)` with no gap or overlap; return V.

    Every rank of the group calls it (one all-reduce of `2 T` integers and one read of them on the host),
    and every rank raises the same error, so none waits on another. Run it once where the layout is fixed
    (a trainer's start-up); the loss functions run it on every call unless told `check_inputs=False`.
    """
    size = group_size(tp_group)
    if size == 1:
        if vocab_start_index != 0:
            raise ValueError(f"vocab_start_index={vocab_start_index} without a tensor-parallel group; pass the "
                             f"tp_group that shards the vocabulary, or 0 for full logits")
        return local_width
    table = torch.zeros(size, 2, dtype=torch.long, device=device)
    table[dist.get_rank(tp_group)] = torch.tensor([vocab_start_index, local_width], device=device)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=tp_group)
    shards = sorted((start, width, rank) for rank, (start, width) in enumerate(table.tolist()))
    end = 0
    for start, width, _rank in shards:
        if start != end or width < 1:
            held = ", ".join(f"rank {r}: [{a}, {a + w})" for a, w, r in sorted(shards, key=lambda t: t[2]))
            raise ValueError(
                f"the vocabulary shards of the TP group do not tile the vocabulary ({held}). Pass each rank's "
                f"LOCAL logit shard (or head shard) with its own vocab_start_index "
                f"(VocabParallelLinear.vocab_start_index), not the full logits.")
        end = start + width
    return end


SUM_EXP_BLOCK_ELEMENTS = 1 << 21  # 8 MiB of float32 temporaries: reused by the allocator, no page faults


def _sum_exp_by_blocks(logits: torch.Tensor, shift: torch.Tensor, out: torch.Tensor) -> None:
    """`out = sum(exp(logits - shift[:, None]), -1)`, a block of rows at a time so the temporary stays
    small (a full `[n, V]` temporary costs as much in fresh pages as the exp itself)."""
    rows = max(1, SUM_EXP_BLOCK_ELEMENTS // max(1, logits.shape[1]))
    for first in range(0, logits.shape[0], rows):
        block = torch.sub(logits[first:first + rows], shift[first:first + rows, None]).to(out.dtype)
        torch.sum(block.exp_(), dim=-1, out=out[first:first + rows])


class _ShardReductions(torch.autograd.Function):
    """Reduce a local logit shard to (shift, sum_exp, target logit, number-token logits) over TP.

    The full-vocabulary log-sum-exp is `shift + log(sum_exp)`, kept in two parts so that softmax
    probabilities are `exp(z - shift) / sum_exp`, as precise as `torch.softmax`.

    Forward: when `need_lse`, one all-reduce MAX over the TP group of the local row maxima (`[n]`)
    giving `shift`, then one all-reduce SUM of a packed `[n, K + 2]` float32 buffer (column 0: the
    local `sum(exp(z - shift))`, column 1: the target logit where this shard owns the target, columns
    2..: the number-token logits this shard owns, zeros elsewhere). Every rank gets identical
    replicated results and computes the same loss from them. No host sync.

    Backward: NO collective. The loss is replicated over the TP group, so each rank's gradient for
    its own columns is complete: `exp(z - shift) * g_sum_exp` for the full-vocabulary part, plus
    `g_target` at the target column and `g_number[:, k]` at each owned number column, written into
    one `[n, V_local]` tensor (scatters, no data-dependent shapes). The gradient w.r.t. the hidden
    states is all-reduced by the parallel LM head's own backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_local: torch.Tensor, target_owned: torch.Tensor,
                layout: ShardLayout, num_numbers: int, need_lse: bool, tp_group) -> tuple:
        n = logits.shape[0]
        parallel = group_size(tp_group) > 1
        dtype = compute_dtype(logits.dtype)
        table = torch.zeros(n, num_numbers + 2, dtype=dtype, device=logits.device)
        shift = torch.zeros(n, dtype=dtype, device=logits.device)
        if need_lse:
            # shift = the row's largest logit over the whole vocabulary: a max is exact, so every TP
            # layout (and one device) sees bitwise the same exp(z - shift) for each column.
            row_max = logits.amax(dim=-1).to(dtype)
            if parallel:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
            # A row whose logits are all -inf would give nan; its sum_exp is 0 and its lse -inf.
            shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
            _sum_exp_by_blocks(logits, shift, out=table[:, 0])
        if target_owned is not None:
            picked = logits.gather(1, target_local.unsqueeze(1)).squeeze(1)
            table[:, 1] = torch.where(target_owned, picked.to(dtype), 0.0)
        if layout.local_number_cols.numel():
            table[:, 2 + layout.owned_number_slots] = logits.index_select(1, layout.local_number_cols).to(dtype)
        if parallel:
            dist.all_reduce(table, op=dist.ReduceOp.SUM, group=tp_group)
        ctx.save_for_backward(logits, shift, target_local if target_owned is not None else None, target_owned)
        ctx.layout = layout
        ctx.mark_non_differentiable(shift)
        return shift, table[:, 0].clone(), table[:, 1].clone(), table[:, 2:].clone()

    @staticmethod
    def backward(ctx, _grad_shift, grad_sum_exp, grad_target, grad_number):
        logits, shift, target_local, target_owned = ctx.saved_tensors
        layout: ShardLayout = ctx.layout
        if grad_sum_exp is not None:
            # d sum_exp / d z = exp(z - shift), written once into the tensor that becomes the gradient
            grad = torch.sub(logits.to(shift.dtype), shift.unsqueeze(1)).exp_().mul_(grad_sum_exp.unsqueeze(1))
        else:
            grad = torch.zeros(logits.shape, dtype=shift.dtype, device=logits.device)
        if grad_target is not None and target_owned is not None:
            owned_grad = torch.where(target_owned, grad_target, 0.0).to(grad.dtype)
            grad.scatter_add_(1, target_local.unsqueeze(1), owned_grad.unsqueeze(1))
        if grad_number is not None and layout.local_number_cols.numel():
            grad.index_add_(1, layout.local_number_cols, grad_number.index_select(1, layout.owned_number_slots))
        return grad.to(logits.dtype), None, None, None, None, None, None


@dataclass
class ShardStats:
    """Replicated results of `shard_reductions` (identical on every rank of the TP group)."""

    shift: torch.Tensor | None  # [n] constant offset of the log-sum-exp (None when not requested)
    sum_exp: torch.Tensor | None  # [n] sum over the full vocabulary of exp(z - shift)
    target_logit: torch.Tensor | None  # [n] logit of the target token (None when not requested)
    number_logits: torch.Tensor  # [n, K] logits of the number tokens, float32 (float64 for float64 logits)
    vocab_size: int | None  # total width of the logits over the TP group (None: layout not checked)

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
                     need_lse: bool = True, tp_group: dist.ProcessGroup | None = None,
                     vocab_start_index: int = 0, ignore_index: int = -100, check: bool = True) -> ShardStats:
    """Full-vocabulary statistics of a local logit shard `[n, V_local]`, in float32 (float64 for
    float64 logits).

    Args:
        logits: the local vocabulary shard of the logits, `[n, V_local]`, any float dtype. Never
            modified.
        number_vocab: the number tokens whose columns are gathered.
        targets: `[n]` global token ids whose logits are wanted (ignore_index rows give 0), or None.
        need_lse: compute the full-vocabulary log-sum-exp (CE, reweigh).
        tp_group: the tensor-parallel group over which the vocabulary is split (None: one device).
        vocab_start_index: the first global vocabulary id of this shard.
        check: check the shard layout over the TP group first (`check_shard_layout`: one small
            all-reduce and a host read); False runs no host sync and leaves `vocab_size` None.
    """
    if logits.dim() != 2:
        raise ValueError(f"shard_reductions expects [n, V_local] logits, got shape {tuple(logits.shape)}")
    n, width = logits.shape
    total_width = check_shard_layout(width, vocab_start_index, tp_group, logits.device) if check else None
    layout = ShardLayout.build(number_vocab, vocab_start_index, width, logits.device)
    target_local = target_owned = None
    if targets is not None:
        if targets.shape != (n,):
            raise ValueError(f"targets must have shape ({n},), got {tuple(targets.shape)}")
        shifted = targets - vocab_start_index
        target_owned = (targets != ignore_index) & (shifted >= 0) & (shifted < width)
        target_local = shifted.clamp(0, width - 1)
    shift, sum_exp, target_logit, number_logits = _ShardReductions.apply(
        logits, target_local, target_owned, layout, len(number_vocab), need_lse, tp_group)
    return ShardStats(shift if need_lse else None, sum_exp if need_lse else None,
                      target_logit if targets is not None else None, number_logits, total_width)
