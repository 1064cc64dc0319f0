"""CE + NTL straight from the hidden states, over chunks of tokens: the full `[n, V]` logits never exist.

Everything CE and NTL need from the logits is, per row, `(shift, sum_exp, target_logit,
number_logits[K])` (see `parallel.py`). `_ChunkedHeadObjective` computes them chunk by chunk from
`hidden @ W^T` and, in the same pass, the parts of the gradient that are known in forward, so no
chunk's logits are computed twice:

- CE: the logit gradient of `ce_sum` is `valid * softmax - onehot(target)`, known as soon as the
  chunk's row statistics are reduced over the TP group. Its products with `W` (hidden gradient) and
  with the hidden states (weight gradient) are accumulated chunk by chunk.
- NTL: after the last chunk, the NTL maths (`ntl.py`) runs once on the small replicated `[n, K]`
  statistics of all rows (so numbers that cross chunk boundaries are fine), and autograd gives the
  gradient of `ntl_sum` w.r.t. the number logits (K columns: tiny matmuls) and, with reweigh, w.r.t.
  the log-sum-exp (dense, but only on the rows that carry an NTL term; those rows' logits are
  recomputed in backward).

The Function's differentiable outputs are the scalars `ce_sum` and `ntl_sum`; any loss built from them
has the gradient `dL/dce_sum * dce_sum + dL/dntl_sum * dntl_sum`, which backward assembles from the
two scalars it receives (loss scale, NTL weight and normalisation included).

Collectives (TP group, every rank, every chunk, whatever the labels): forward one all-reduce MAX of
`c` floats and one all-reduce SUM of `c * (K + 2)` floats per chunk of `c` rows (the reduction of
`parallel.reduce_shard_rows`, shared with the full-logits path); backward one all-reduce SUM of the
`[n, H]` hidden gradient (the vocabulary-parallel head's own backward would do the same). With T = 1
there is no collective. With `check_inputs=True` (the default) the shard layout is checked first
(`VocabShard.check_tiling`, one small all-reduce and a host read); with False nothing reads a tensor on
the host, except the row count of the reweigh recompute (reweigh only).

DeepSpeed: the objective runs inside the LM head module's own call (`head(hidden)`), through hooks
installed for that one call, so ZeRO-3 gathers the head weight for the forward and again for the
backward, releases it after each, and its gradient reaches ZeRO's reduction hooks exactly as for the
plain head. `chunked_model_ce_ntl_sums` calls the whole model (the DeepSpeed engine), so the engine's
forward bookkeeping (backward prologue, gradient accumulation scaling) sees the objective as the
model's output.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.numbers import NumberVocab
from .ntl import NTLSettings, NumberSpans
from .objective import ObjectiveSums, check_loss_inputs, check_on_host, sums_from_stats
from .parallel import NumberColumns, ShardStats, compute_dtype, reduce_shard_rows
from .shard import VocabShard, vocab_shard_of


@dataclass
class _Plan:
    """Everything the chunked objective needs besides the hidden states and the head's parameters."""

    labels: torch.Tensor  # [...] labels in the caller's shape (rows matter for number-level NTL)
    loss_weights: torch.Tensor | None  # [...] NTL weights or None
    number_vocab: NumberVocab
    settings: NTLSettings
    with_ntl: bool
    chunk_tokens: int
    backward: str  # "rows" or "vocab_blocks" (CHUNK_BACKWARDS; "auto" resolved by `resolve_chunk_backward`)
    shard: VocabShard  # where the head's rows sit in the vocabulary
    check_inputs: bool  # host checks (shard layout, labels in the vocabulary); False: no host sync
    spans: NumberSpans | None = None  # number-level spans of a sequence shard (`sequence_shard.shard_number_spans`)


class _ChunkedHeadObjective(torch.autograd.Function):
    """`(hidden [n, H], weight [V_local, H], bias [V_local] | None) -> ObjectiveSums.stack() [6]` (see the
    module docstring).

    Forward: per chunk, one all-reduce MAX (`c` floats) and one all-reduce SUM (`c * (K + 2)` floats)
    over the TP group. Backward: one all-reduce SUM of the `[n, H]` hidden gradient over the
    TP group (the hidden states are replicated over it, each rank holds a vocabulary shard).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: _Plan,
                need_grads: tuple[bool, bool, bool]) -> torch.Tensor:
        n, width = hidden.shape[0], weight.shape[0]
        device, dtype = hidden.device, compute_dtype(hidden.dtype)
        number_vocab, settings, shard = plan.number_vocab, plan.settings, plan.shard
        shard.check_width(width, "the LM head's weight rows")  # the width is known while ZeRO-3 has it gathered
        columns = NumberColumns.build(number_vocab, shard.start, width, device)
        flat_labels = plan.labels.reshape(-1).long()
        valid = flat_labels != settings.ignore_index
        target_cols, target_owned = shard.local_targets(flat_labels, width, settings.ignore_index)
        need_hidden_grad, need_weight_grad, need_bias_grad = need_grads
        need_any_grad = any(need_grads)
        # "rows": the CE gradient is accumulated here, chunk by chunk; "vocab_blocks": forward keeps the row
        # statistics only and backward recomputes the logits a vocabulary block at a time.
        grads_in_forward = need_any_grad and plan.backward == "rows"
        need_hidden_grad, need_weight_grad, need_bias_grad = (want and grads_in_forward for want in need_grads)

        shift = torch.empty(n, dtype=dtype, device=device)
        sum_exp = torch.empty(n, dtype=dtype, device=device)
        target_logit = torch.empty(n, dtype=dtype, device=device)
        number_logits = torch.empty(n, len(number_vocab), dtype=dtype, device=device)
        # Gradient accumulators in the compute dtype (float32 for bf16/fp16 heads): summing one partial
        # product per chunk into a bf16 buffer would round after every chunk (error growing with the
        # chunk count); each is cast to its parameter's dtype once, at the end of backward.
        hidden_grad_ce = torch.empty(hidden.shape, dtype=dtype, device=device) if need_hidden_grad else None
        weight_grad = torch.zeros(weight.shape, dtype=dtype, device=device) if need_weight_grad else None
        bias_grad = torch.zeros(width, dtype=dtype, device=device) if need_bias_grad else None
        if plan.check_inputs:
            check_on_host(shard, width, flat_labels, number_vocab, settings.ignore_index, device)

        for first in range(0, n, plan.chunk_tokens):
            rows = slice(first, min(first + plan.chunk_tokens, n))
            chunk = hidden[rows]
            # the chunk's logits become exp(z - shift) in place: they exist once, for the reduction and the gradient
            chunk_shift, table, probs = reduce_shard_rows(
                F.linear(chunk, weight, bias), columns, len(number_vocab), target_cols[rows], target_owned[rows],
                shard.tp_group, exp_in_place=True)
            shift[rows], sum_exp[rows], target_logit[rows], number_logits[rows] = (
                chunk_shift, table[:, 0], table[:, 1], table[:, 2:])
            if grads_in_forward:
                # logit gradient of ce_sum: valid * softmax - onehot(target), written over probs
                probs.mul_((valid[rows].to(dtype) / table[:, 0]).unsqueeze(1))
                probs.scatter_add_(1, target_cols[rows].unsqueeze(1), target_owned[rows].to(dtype).neg().unsqueeze(1))
                _accumulate_grads(probs, chunk, weight, rows, hidden_grad_ce, weight_grad, bias_grad)
            del probs

        stats = ShardStats(shift, sum_exp, target_logit, number_logits)
        result, ntl_grads = _objective_from_stats(stats, plan, need_any_grad, dense_reweigh=not grads_in_forward)
        ctx.plan, ctx.columns, ctx.need_grads = plan, columns, need_grads
        ctx.grads_ce = (hidden_grad_ce, weight_grad, bias_grad)
        ctx.ntl_grads = ntl_grads
        ctx.weight, ctx.bias = weight, bias  # parameters: gathered again by ZeRO-3 before backward
        if grads_in_forward or not need_any_grad:
            ctx.save_for_backward(hidden, shift)
        else:
            ctx.save_for_backward(hidden, shift, sum_exp, valid, target_cols, target_owned)
        ctx.used = False
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_packed: torch.Tensor):
        if ctx.used:
            raise RuntimeError("the chunked CE + NTL objective keeps one set of precomputed gradients and supports "
                               "a single backward pass (do not use retain_graph=True through it)")
        ctx.used = True
        grads_of = ObjectiveSums.unstack(grad_packed)  # only ce_sum and ntl_sum are differentiable
        grad_ce, grad_ntl = grads_of.ce_sum, grads_of.ntl_sum
        if ctx.plan.backward == "vocab_blocks":
            hidden_grad, weight_grad, bias_grad = _vocab_block_grads(ctx, grad_ce, grad_ntl)
            return _finish_grads(ctx, hidden_grad, weight_grad, bias_grad)
        hidden, shift = ctx.saved_tensors
        weight, bias, columns, plan = ctx.weight, ctx.bias, ctx.columns, ctx.plan
        hidden_grad, weight_grad, bias_grad = ctx.grads_ce
        ctx.grads_ce = (None, None, None)
        for grad in (hidden_grad, weight_grad, bias_grad):
            if grad is not None:
                grad.mul_(grad_ce.to(grad.dtype))
        if ctx.ntl_grads is not None:
            number_grad, reweigh_rows, reweigh_grad = ctx.ntl_grads
            if columns.local_cols.numel():
                # the number-token columns this shard owns
                grad_cols = number_grad.index_select(1, columns.slots) * grad_ntl
                cols = columns.local_cols
                if hidden_grad is not None:
                    hidden_grad.add_(_matmul(grad_cols, weight.index_select(0, cols), hidden_grad.dtype))
                if weight_grad is not None:
                    weight_grad.index_add_(0, cols, _matmul(grad_cols.t(), hidden, weight_grad.dtype))
                if bias_grad is not None:
                    bias_grad.index_add_(0, cols, grad_cols.sum(0))
            if reweigh_rows is not None:
                # d ntl / d sum_exp is dense over the vocabulary at the rows with an NTL term: recompute
                # those rows' logits, chunk by chunk, as `exp(z - shift) * g`.
                for first in range(0, reweigh_rows.numel(), plan.chunk_tokens):
                    rows = reweigh_rows[first:first + plan.chunk_tokens]
                    chunk = hidden.index_select(0, rows)
                    probs = F.linear(chunk, weight, bias).to(shift.dtype).sub_(shift[rows].unsqueeze(1)).exp_()
                    probs.mul_((reweigh_grad[first:first + plan.chunk_tokens] * grad_ntl).unsqueeze(1))
                    _accumulate_grads(probs, chunk, weight, rows, hidden_grad, weight_grad, bias_grad)
                    del probs  # before the next chunk's logits exist
        return _finish_grads(ctx, hidden_grad, weight_grad, bias_grad)


def _finish_grads(ctx, hidden_grad: torch.Tensor | None, weight_grad: torch.Tensor | None,
                  bias_grad: torch.Tensor | None) -> tuple:
    """All-reduce the hidden gradient over the TP group and cast the accumulators to the inputs' dtypes."""
    plan = ctx.plan
    if hidden_grad is not None and plan.shard.is_split:
        # each rank holds the contribution of its vocabulary shard
        dist.all_reduce(hidden_grad, op=dist.ReduceOp.SUM, group=plan.shard.tp_group)
    if bias_grad is not None:
        bias_grad = bias_grad.to(ctx.bias.dtype)
    if weight_grad is not None:
        weight_grad = weight_grad.to(ctx.weight.dtype)
    if hidden_grad is not None:
        hidden_grad = hidden_grad.to(ctx.saved_tensors[0].dtype)
    return hidden_grad, weight_grad, bias_grad, None, None


def _vocab_block_grads(ctx, grad_ce: torch.Tensor, grad_ntl: torch.Tensor) -> tuple:
    """The gradients of `grad_ce * ce_sum + grad_ntl * ntl_sum` from the logits recomputed one vocabulary block
    at a time over all rows (`backward="vocab_blocks"`): each block's logit gradient is
    `exp(z - shift) * row_scale - grad_ce * onehot(target) + grad_ntl * dntl/dnumber_logits`, where `row_scale`
    carries the softmax of CE and, with reweigh, `grad_ntl * dntl/dsum_exp`; its products give that block's
    rows of the weight gradient (one GEMM over all rows, written once) and its part of the hidden gradient
    (float32 accumulator). The blocks hold as many logits as a forward chunk. No collective, no host sync."""
    hidden, shift, sum_exp, valid, target_cols, target_owned = ctx.saved_tensors
    weight, bias, plan = ctx.weight, ctx.bias, ctx.plan
    need_hidden_grad, need_weight_grad, need_bias_grad = ctx.need_grads
    n, width = hidden.shape[0], weight.shape[0]
    dtype = shift.dtype
    row_scale = valid.to(dtype) * grad_ce.to(dtype) / sum_exp
    target_grad = target_owned.to(dtype) * grad_ce.to(dtype).neg()
    number_grad = None
    if ctx.ntl_grads is not None:
        number_grad, _, reweigh_grad = ctx.ntl_grads
        number_grad = number_grad * grad_ntl.to(dtype)
        if reweigh_grad is not None:
            row_scale = row_scale + reweigh_grad * grad_ntl.to(dtype)
    hidden_grad = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden_grad else None
    weight_grad = torch.empty_like(weight) if need_weight_grad else None
    bias_grad = torch.empty(width, dtype=dtype, device=hidden.device) if need_bias_grad else None
    block_cols = vocab_block_columns(n, width, plan.chunk_tokens)
    for first in range(0, width, block_cols):
        last = min(first + block_cols, width)
        logits = F.linear(hidden, weight[first:last], None if bias is None else bias[first:last])
        grad = logits.to(dtype) if logits.dtype != dtype else logits
        del logits
        grad.sub_(shift.unsqueeze(1)).exp_().mul_(row_scale.unsqueeze(1))
        in_block = target_owned & (target_cols >= first) & (target_cols < last)
        grad.scatter_add_(1, (target_cols - first).clamp_(0, last - first - 1).unsqueeze(1),
                          torch.where(in_block, target_grad, 0.0).unsqueeze(1))
        if number_grad is not None:
            # the block's number-token columns: the shard layout's own lookup, for the block's column range
            block_numbers = NumberColumns.build(plan.number_vocab, plan.shard.start + first, last - first, grad.device)
            if block_numbers.local_cols.numel():
                grad.index_add_(1, block_numbers.local_cols, number_grad.index_select(1, block_numbers.slots))
        if bias_grad is not None:
            torch.sum(grad, 0, out=bias_grad[first:last])
        low = grad.to(weight.dtype)
        if weight_grad is not None:
            torch.mm(low.t(), hidden, out=weight_grad[first:last])
        if hidden_grad is not None:
            _add_product(hidden_grad, grad, low, weight[first:last])
        del grad, low
    return hidden_grad, weight_grad, bias_grad


def vocab_block_columns(rows: int, width: int, chunk_tokens: int) -> int:
    """Vocabulary columns per backward block of `backward="vocab_blocks"`: a block of `rows` rows holds about as
    many logits as a forward chunk (`chunk_tokens x width`)."""
    return max(1, min(width, math.ceil(width * chunk_tokens / max(rows, 1))))


def _accumulate_grads(logit_grad: torch.Tensor, chunk: torch.Tensor, weight: torch.Tensor, rows: slice | torch.Tensor,
                      hidden_grad: torch.Tensor | None, weight_grad: torch.Tensor | None,
                      bias_grad: torch.Tensor | None) -> None:
    """Add the contributions of one chunk's `[c, V_local]` logit gradient (float32) to the hidden, weight
    and bias gradients (float32 accumulators for bf16/fp16 heads). The hidden rows of a chunk are one
    product over the vocabulary, run in the head's dtype as the unchunked head's backward does; the weight
    gradient sums a product per chunk, so each is added in float32."""
    if bias_grad is not None:
        bias_grad.add_(logit_grad.sum(0))
    grad = logit_grad.to(weight.dtype)
    if hidden_grad is not None:
        if isinstance(rows, slice) and hidden_grad.dtype == weight.dtype:
            torch.mm(grad, weight, out=hidden_grad[rows])
        elif isinstance(rows, slice):
            hidden_grad[rows] = grad @ weight
        else:
            hidden_grad.index_add_(0, rows, (grad @ weight).to(hidden_grad.dtype))
    if weight_grad is not None:
        _add_product(weight_grad, logit_grad.t(), grad.t(), chunk.to(weight.dtype))


def _add_product(accumulator: torch.Tensor, left: torch.Tensor, left_low: torch.Tensor, right: torch.Tensor) -> None:
    """`accumulator += left @ right` in the accumulator's dtype (float32 for a bf16/fp16 `right`), given `left` in
    float32 and `left_low` in `right`'s dtype: a low-precision GEMM writing float32 where the device has one, else
    (e.g. CPU) the float32 product."""
    if accumulator.dtype == right.dtype:
        accumulator.addmm_(left_low, right)
    elif _has_low_precision_gemm_into_float32(accumulator.device):
        torch.addmm(accumulator, left_low, right, out_dtype=accumulator.dtype, out=accumulator)
    else:
        accumulator.addmm_(left, right.to(accumulator.dtype))


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` in `b`'s dtype, returned as `out_dtype`."""
    return (a.to(b.dtype) @ b).to(out_dtype)


@functools.cache
def _has_low_precision_gemm_into_float32(device: torch.device) -> bool:
    """Whether bf16/fp16 GEMMs can write float32 outputs on this device (`torch.addmm(..., out_dtype=)`,
    PyTorch >= 2.8 on CUDA), asked of the dispatcher rather than found by trying one."""
    try:
        key = torch._C._dispatch_key_for_device(device.type)
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", key)
    except (AttributeError, RuntimeError):
        return False


def _objective_from_stats(stats: ShardStats, plan: _Plan, need_grads: bool, dense_reweigh: bool):
    """CE and NTL sums (`objective.sums_from_stats`) from the reduced statistics, stacked
    (`ObjectiveSums.stack`); and, when gradients are wanted, the gradient of `ntl_sum` w.r.t. the statistics:
    `(number_grad [n, K], reweigh_rows, reweigh_grad)`, with reweigh the rows that carry a `sum_exp` gradient and
    that gradient (`dense_reweigh`: `reweigh_rows` None and the gradient of every row, no host sync)."""
    settings = plan.settings
    want_ntl_grads = need_grads and plan.with_ntl
    with torch.enable_grad():
        number_logits = stats.number_logits.detach().requires_grad_(want_ntl_grads)
        sum_exp = stats.sum_exp.detach().requires_grad_(want_ntl_grads and settings.reweigh)
        leaf_stats = ShardStats(stats.shift, sum_exp, stats.target_logit, number_logits)
        sums = sums_from_stats(leaf_stats, plan.labels, plan.number_vocab, settings, loss_weights=plan.loss_weights,
                               with_ntl=plan.with_ntl, spans=plan.spans)
    packed = sums.stack()
    if not want_ntl_grads or not sums.ntl_sum.requires_grad:
        return packed, None
    inputs = [number_logits, sum_exp] if settings.reweigh else [number_logits]
    grads = torch.autograd.grad(sums.ntl_sum, inputs, allow_unused=True)
    number_grad = grads[0] if grads[0] is not None else torch.zeros_like(number_logits)
    if not settings.reweigh or grads[1] is None:
        return packed, (number_grad, None, None)
    if dense_reweigh:
        return packed, (number_grad, None, grads[1])
    # the one host sync of the chunked head, reweigh only: how many rows backward recomputes (recomputing
    # every row instead would cost a second full head pass)
    reweigh_rows = torch.nonzero(grads[1]).flatten()
    return packed, (number_grad, reweigh_rows, grads[1][reweigh_rows])


# ------------------------------------------------------------------------------------ the head call
class _HeadCall:
    """State of one armed call of the LM head: the request going in, the packed objective coming out."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.hidden: torch.Tensor | None = None
        self.computed: torch.Tensor | None = None
        self.returned: torch.Tensor | None = None
        self.calls = 0

    def capture_input(self, module: torch.nn.Module, args: tuple) -> tuple:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("the LM head was called twice in one forward with the chunked objective armed; "
                               "chunk_tokens supports models that call their head once per forward")
        if len(args) != 1 or not torch.is_tensor(args[0]) or args[0].dim() < 2:
            raise TypeError("the chunked objective expects the LM head to be called with one [..., n, H] tensor (the "
                            "hidden states) as its only positional argument")
        _check_head_call(args[0], module.weight, self.plan)
        self.hidden = args[0]
        # The head's own forward runs on zero rows: its hooks (ZeRO-3 gather and release) still run,
        # its [n, V] matmul does not.
        return (args[0].narrow(-2, 0, 0),)

    def compute(self, module: torch.nn.Module, args: tuple, output: Any) -> torch.Tensor:
        weight, bias = module.weight, getattr(module, "bias", None)
        hidden = self.hidden
        self.hidden = None
        flat = hidden.reshape(-1, hidden.shape[-1])
        grad_on = torch.is_grad_enabled()
        need_grads = (grad_on and flat.requires_grad, grad_on and weight.requires_grad,
                      grad_on and bias is not None and bias.requires_grad)
        self.computed = _ChunkedHeadObjective.apply(flat, weight, bias, self.plan, need_grads)
        return self.computed

    def record_output(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.returned = output


def _check_head_call(hidden: torch.Tensor, weight: torch.Tensor, plan: _Plan) -> None:
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"the LM head's weight must be a [V, H] matrix while the head runs, got shape "
                         f"{tuple(weight.shape)}; under ZeRO-3 call the head module (not its weight) so that "
                         f"DeepSpeed gathers it")
    if not torch.is_floating_point(hidden):
        raise TypeError(f"hidden states must be floating point, got {hidden.dtype}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the LM head's input size {weight.shape[1]}")
    if tuple(hidden.shape[:-1]) != tuple(plan.labels.shape):
        raise ValueError(f"the LM head got hidden states of shape {tuple(hidden.shape)} but the labels have shape "
                         f"{tuple(plan.labels.shape)}: labels must be aligned with every position the head sees "
                         f"(already shifted), and the model must not drop positions (logits_to_keep)")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden states ({hidden.dtype}) and LM head weight ({weight.dtype}) must share a dtype")


@contextmanager
def _armed(head: torch.nn.Module, plan: _Plan) -> Iterator[_HeadCall]:
    """Hooks on `head` for the calls made inside the context.

    Installed per call and removed after it, so their order around DeepSpeed's own hooks is fixed:
    the input capture runs after ZeRO-3's gather (and its post-backward wrapping of the input), the
    computation before ZeRO-3's release (and its pre-backward wrapping of the output).
    """
    call = _HeadCall(plan)
    handles = [head.register_forward_pre_hook(call.capture_input),
               head.register_forward_hook(call.compute, prepend=True),
               head.register_forward_hook(call.record_output)]
    try:
        yield call
    finally:
        for handle in handles:
            handle.remove()


def _make_plan(head: torch.nn.Module, labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings,
               chunk_tokens: int, shard: VocabShard | None, loss_weights: torch.Tensor | None, with_ntl: bool,
               check_inputs: bool, backward: str, spans: NumberSpans | None = None) -> _Plan:
    check_loss_inputs(labels, number_vocab, loss_weights, check_values=check_inputs)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens per chunk, got {chunk_tokens!r}")
    if not isinstance(head, torch.nn.Module) or not hasattr(head, "weight"):
        raise TypeError(f"head must be the model's LM head module (nn.Linear or DeepSpeed's VocabParallelLinear), "
                        f"got {type(head).__name__}")
    head_shard = vocab_shard_of(head)
    if shard is None:
        shard = head_shard
    elif head_shard.is_split and (
            not shard.is_split or shard.start != head_shard.start
            or dist.get_process_group_ranks(shard.tp_group) != dist.get_process_group_ranks(head_shard.tp_group)):
        raise ValueError(f"the head is vocabulary-parallel (DeepSpeed VocabParallelLinear, columns from "
                         f"{head_shard.start}); pass no shard (the head's own) or shard=vocab_shard_of(model), got "
                         f"{shard}")
    return _Plan(labels=labels, loss_weights=loss_weights, number_vocab=number_vocab, settings=settings,
                 with_ntl=with_ntl, chunk_tokens=chunk_tokens,
                 backward=resolve_chunk_backward(backward, chunk_tokens, labels.numel(), labels.device.type),
                 shard=shard, check_inputs=check_inputs, spans=spans)


CHUNK_BACKWARDS = ("auto", "rows", "vocab_blocks")
# "auto" takes "vocab_blocks" for chunks of fewer rows than this: there the per-chunk float32 read-modify-write
# of the [V_local, H] weight gradient ("rows") costs more than the extra logit GEMM of "vocab_blocks". The
# crossover is about 4x the device's FLOP/byte ratio: measured at 32 rows on a 2-core CPU in float32
# (docs/chunked.md); for GPUs in bf16 (about 200-300 FLOP/byte on H100/H200) estimated, not measured.
ROWS_BACKWARD_MIN_CHUNK_TOKENS = {"cpu": 32}
ROWS_BACKWARD_MIN_CHUNK_TOKENS_ACCELERATOR = 1024  # CUDA and any other device


def resolve_chunk_backward(backward: str, chunk_tokens: int, rows: int, device_type: str) -> str:
    """The gradient algorithm of the chunked head, "rows" or "vocab_blocks", for `backward` (CHUNK_BACKWARDS).

    "rows": each chunk's logit gradient is formed in forward and multiplied into the hidden and weight
    gradients at once (three GEMMs over the logits in all; one `[V_local, H]` float32 accumulation per chunk).
    "vocab_blocks" (DeepSpeed's fused head's scheme): forward keeps the row statistics, backward recomputes the
    logits one vocabulary block at a time over all rows (four GEMMs; each weight-gradient block written once).
    "auto": "rows" when one chunk takes every row or chunks have at least ROWS_BACKWARD_MIN_CHUNK_TOKENS rows
    for `device_type`, "vocab_blocks" otherwise.
    """
    if backward not in CHUNK_BACKWARDS:
        raise ValueError(f"backward must be one of {', '.join(CHUNK_BACKWARDS)}, got {backward!r}")
    if backward != "auto":
        return backward
    threshold = ROWS_BACKWARD_MIN_CHUNK_TOKENS.get(device_type, ROWS_BACKWARD_MIN_CHUNK_TOKENS_ACCELERATOR)
    return "rows" if chunk_tokens >= min(rows, threshold) else "vocab_blocks"


def chunked_ce_ntl_sums(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, number_vocab: NumberVocab,
                        settings: NTLSettings = NTLSettings(), *, chunk_tokens: int, shard: VocabShard | None = None,
                        loss_weights: torch.Tensor | None = None, with_ntl: bool = True,
                        check_inputs: bool = True, backward: str = "auto",
                        spans: NumberSpans | None = None) -> ObjectiveSums:
    """`ce_ntl_sums(head(hidden), labels, ...)` without ever holding more than `chunk_tokens` rows of logits.

    Same meaning, values and gradients (float32 round-off) as `objective.ce_ntl_sums` on the head's
    logits. `ce_sum` and `ntl_sum` are differentiable w.r.t. `hidden` and the head's weight (and bias):
    combine them into any loss and call backward once.

    Args:
        hidden: `[..., H]` input of the LM head (the model's last hidden states), replicated over the TP
            group.
        head: the LM head module: `nn.Linear` (bias allowed) or DeepSpeed AutoTP's `VocabParallelLinear`.
            It is called once (its forward runs on zero rows), so DeepSpeed's hooks on it run; under
            ZeRO-3 this is what gathers its weight. Do not call this on a model wrapped in a
            DeepSpeed engine's forward: use `chunked_model_ce_ntl_sums` there.
        labels: `[...]` target ids aligned with `hidden` (already shifted), identical on every TP rank.
        number_vocab, settings, loss_weights, with_ntl: as in `ce_ntl_sums`.
        chunk_tokens: rows of logits computed at a time (memory: `chunk_tokens x V_local` floats, a few
            times over).
        shard: where the head's rows sit in the vocabulary; None: the head's own (`vocab_shard_of(head)`:
            AutoTP's VocabParallelLinear knows its shard, any other head is the full vocabulary). Give it
            for a head that holds one shard without knowing it (a plain `nn.Linear` of the shard's rows).
        check_inputs: as in `ce_ntl_sums` (False: no host sync, except the one of reweigh with
            `backward="rows"`, see docs/chunked.md).
        backward: how the gradient is computed, "rows", "vocab_blocks" or "auto" (`resolve_chunk_backward`);
            the values and gradients are the same, the cost differs.
        spans: "number_level" on a sequence shard, as in `ce_ntl_sums`. The NTL gradient is formed in forward
            (its exchange's backward all-reduce runs there), so the gradient that later reaches `ntl_sum` must
            be the same on every rank of the sequence-parallel group: the trainer's global normaliser is.
    """
    plan = _make_plan(head, labels, number_vocab, settings, chunk_tokens, shard, loss_weights, with_ntl, check_inputs,
                      backward, spans)
    with _armed(head, plan) as call:
        packed = head(hidden)
    if call.computed is None:
        raise RuntimeError("the LM head's hooks did not run; chunked_ce_ntl_sums needs a head module whose forward "
                           "hooks are honoured")
    return ObjectiveSums.unstack(packed)


def chunked_model_ce_ntl_sums(model: Any, head: torch.nn.Module, inputs: dict, labels: torch.Tensor,
                              number_vocab: NumberVocab, settings: NTLSettings = NTLSettings(), *, chunk_tokens: int,
                              shard: VocabShard | None = None, loss_weights: torch.Tensor | None = None,
                              with_ntl: bool = True,
                              check_inputs: bool = True, backward: str = "auto",
                              spans: NumberSpans | None = None) -> ObjectiveSums:
    """Forward of a causal LM (a DeepSpeed engine or a HF model) with its head replaced by the chunked
    CE + NTL objective; the replacement for `ce_ntl_sums(model(**inputs).logits, labels, ...)`.

    The model's forward runs as usual (for an engine: `engine(**inputs)`, with all its hooks) and
    passes its last hidden states to `head` (`model.get_output_embeddings()`); the head's output,
    which the model returns as `.logits`, is the packed objective instead of the logits. Models that
    transform the head's output (final logit soft-capping, scaling) are refused.

    Args:
        model: the callable that runs the forward (`engine` or the HF model itself).
        head: the model's LM head module.
        inputs: keyword arguments of the forward (`input_ids`, `attention_mask`, ...), without labels.
        check_inputs: as in `chunked_ce_ntl_sums`, and also whether the model returns the head's output
            unchanged (a value comparison, a host sync; without it only the shape is compared).
        Others: as in `chunked_ce_ntl_sums`.
    """
    if "labels" in inputs:
        raise ValueError("do not pass labels to the model: it would compute its own loss on the head's output; "
                         "pass them to chunked_model_ce_ntl_sums")
    plan = _make_plan(head, labels, number_vocab, settings, chunk_tokens, shard, loss_weights, with_ntl, check_inputs,
                      backward, spans)
    with _armed(head, plan) as call:
        output = model(**inputs)
    if call.computed is None:
        raise RuntimeError(f"{type(head).__name__} (the head passed) was not called by the model's forward; pass "
                           f"the model's own LM head (model.get_output_embeddings())")
    packed = getattr(output, "logits", None)
    if packed is None and isinstance(output, (tuple, list)) and output:
        packed = output[0]
    # ZeRO-3 wraps module outputs in identity autograd nodes, so compare values, not tensor identity; the
    # value comparison reads the device (torch.equal), so it is one of the input checks: a trainer runs it once
    if not (torch.is_tensor(packed) and packed.shape == call.returned.shape
            and (not check_inputs or torch.equal(packed.detach(), call.returned.detach()))):
        raise ValueError(f"{type(model).__name__} transforms its LM head's output before returning it as logits "
                         f"(e.g. final logit soft-capping); chunk_tokens needs a model that returns the head's "
                         f"output unchanged. Set chunk_tokens to 0 for this model.")
    return ObjectiveSums.unstack(packed)
