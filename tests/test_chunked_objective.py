"""Chunked CE + NTL head (one process): the same sums and gradients as the unchunked objective on the
head's logits, for every NTL variant, chunk sizes that do and do not divide the tokens, chunks without
number tokens, bias, bf16, HF models (tied and untied heads), no-grad evaluation; never a full-size
logit tensor; errors that name the problem."""

from __future__ import annotations


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.models import tiny_llama
from helpers.numeric import relative_error
from helpers.variants import every_variant_settings
from ntl_pretrain.loss import NTLSettings, VocabShard, ce_ntl_sums
from ntl_pretrain.loss.chunked import (ROWS_BACKWARD_MIN_CHUNK_TOKENS, ROWS_BACKWARD_MIN_CHUNK_TOKENS_ACCELERATOR,
                                       chunked_ce_ntl_sums, chunked_model_ce_ntl_sums, resolve_chunk_backward)
from ntl_pretrain.numbers import NumberVocab

pytestmark = pytest.mark.timeout(120)

VOCAB, TOKENIZER_SIZE, HIDDEN = 64, 60, 16
NUMBER_IDS = [3, 9, 17, 22, 30, 35, 41, 47, 52, 58]  # spread over the vocabulary, not in value order
VALUES = [7, 3, 0, 9, 1, 5, 2, 8, 4, 6]
DOT_ID = 1  # the '.' token (del reads decimals)
SETTINGS = every_variant_settings(NTLSettings(variant="was", squash_factor=3.0),
                                  NTLSettings(variant="was", smoothing_sigma=0.8))
SUM_FIELDS = ("token_count", "ntl_count", "number_tokens", "abs_error_sum")
BACKWARDS = ["rows", "vocab_blocks"]  # the two gradient algorithms (chunked.resolve_chunk_backward)


def number_vocab() -> NumberVocab:
    return NumberVocab(tuple(NUMBER_IDS), tuple(float(v) for v in VALUES), TOKENIZER_SIZE, decimal_point_id=DOT_ID)


def make_labels(seed: int = 0, rows: int = 2, length: int = 13) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, TOKENIZER_SIZE, (rows, length), generator=generator)
    digits = torch.rand(rows, length, generator=generator) < 0.5
    labels[digits] = torch.tensor(NUMBER_IDS)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[0, :5] = torch.tensor([0, 1, 2, 4, 61])  # the first chunks hold no number token
    labels[0, 6:11] = torch.tensor(NUMBER_IDS[:2] + [DOT_ID] + NUMBER_IDS[2:4])  # a decimal across chunk boundaries
    labels[1, :3] = -100
    return labels


def combine(sums):
    """A non-linear use of both sums: the gradient must be right for any loss built from them."""
    return sums.ce_sum * sums.ntl_sum + 0.3 * sums.ce_sum - 0.7 * sums.ntl_sum


def reference_and_grads(hidden, head, labels, settings, **kwargs):
    hidden = hidden.detach().clone().requires_grad_()
    sums = ce_ntl_sums(head(hidden), labels, number_vocab(), settings, **kwargs)
    loss = combine(sums)
    return sums, loss, torch.autograd.grad(loss, [hidden, *head.parameters()])


def chunked_and_grads(hidden, head, labels, settings, chunk_tokens, backward="auto", **kwargs):
    hidden = hidden.detach().clone().requires_grad_()
    sums = chunked_ce_ntl_sums(hidden, head, labels, number_vocab(), settings, chunk_tokens=chunk_tokens,
                               backward=backward, **kwargs)
    loss = combine(sums)
    return sums, loss, torch.autograd.grad(loss, [hidden, *head.parameters()])


def compare(hidden, head, labels, settings, chunk_tokens, tolerance, backward, **kwargs) -> None:
    ref_sums, ref_loss, ref_grads = reference_and_grads(hidden, head, labels, settings, **kwargs)
    sums, loss, grads = chunked_and_grads(hidden, head, labels, settings, chunk_tokens, backward, **kwargs)
    where = f"{settings}, chunk_tokens={chunk_tokens}, backward={backward}"
    assert relative_error(loss, ref_loss) <= tolerance, where
    for name in ("ce_sum", "ntl_sum", *SUM_FIELDS):
        assert relative_error(getattr(sums, name), getattr(ref_sums, name)) <= tolerance, (name, where)
    names = ["hidden"] + [name for name, _ in head.named_parameters()]
    for name, grad, ref_grad in zip(names, grads, ref_grads):
        assert ref_grad.norm() > 0, name
        assert relative_error(grad, ref_grad) <= tolerance, (name, where)


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_variant_matches_the_unchunked_objective_float64(bias, backward):
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias).double()
    hidden = torch.randn(2, 13, HIDDEN, dtype=torch.float64) * 2
    labels = make_labels()
    for settings in SETTINGS:
        # 1 and 7 do not divide 26 rows, 26 is one chunk, 100 more than all rows
        for chunk_tokens in (1, 7, 26, 100):
            compare(hidden, head, labels, settings, chunk_tokens, 1e-11, backward)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_float32_with_loss_weights_and_ce_only(backward):
    torch.manual_seed(1)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(3, 11, HIDDEN)
    labels = make_labels(seed=3, rows=3, length=11)
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(4))
    for settings in (NTLSettings(), NTLSettings(variant="number_level", reweigh=True)):
        compare(hidden, head, labels, settings, 5, 2e-6, backward, loss_weights=weights)
    # CE only: the NTL sum is zero and does not move anything, the monitoring figures stay
    ref_sums, _, _ = reference_and_grads(hidden, head, labels, NTLSettings(), with_ntl=False)
    hidden_ours = hidden.clone().requires_grad_()
    sums = chunked_ce_ntl_sums(hidden_ours, head, labels, number_vocab(), chunk_tokens=4, with_ntl=False,
                               backward=backward)
    assert sums.ntl_sum.item() == 0 and sums.ntl_count.item() == 0
    assert relative_error(sums.abs_error_sum, ref_sums.abs_error_sum) < 1e-6
    (sums.ce_sum + sums.ntl_sum).backward()
    hidden_ref = hidden.clone().requires_grad_()
    ce_ntl_sums(head(hidden_ref), labels, number_vocab(), with_ntl=False).ce_sum.backward()
    assert relative_error(hidden_ours.grad, hidden_ref.grad) < 2e-6


class _FunctionalHead(torch.nn.Module):
    """A linear head over given tensors (not parameters), so gradcheck can perturb them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight, self.bias)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_gradient_matches_finite_differences(backward):
    generator = torch.Generator().manual_seed(2)
    labels = make_labels(seed=5, rows=2, length=12)
    settings = NTLSettings(variant="number_level", reweigh=True)

    def objective(hidden, weight, bias):
        sums = chunked_ce_ntl_sums(hidden, _FunctionalHead(weight, bias), labels, number_vocab(), settings,
                                   chunk_tokens=4, backward=backward)
        return sums.ce_sum + 0.5 * sums.ntl_sum

    inputs = [torch.randn(shape, dtype=torch.float64, generator=generator).requires_grad_()
              for shape in ((2, 12, HIDDEN), (VOCAB, HIDDEN), (VOCAB,))]
    grads = torch.autograd.grad(objective(*inputs), inputs)
    # directional derivatives by central differences (gradcheck would run backward more than once)
    step = 1e-6
    for _ in range(4):
        directions = [torch.randn(x.shape, dtype=torch.float64, generator=generator) for x in inputs]
        with torch.no_grad():
            plus = objective(*[x + step * d for x, d in zip(inputs, directions)])
            minus = objective(*[x - step * d for x, d in zip(inputs, directions)])
        numeric = (plus - minus) / (2 * step)
        analytic = sum((g * d).sum() for g, d in zip(grads, directions))
        assert abs(numeric - analytic) <= 1e-6 * abs(analytic) + 1e-8, (numeric, analytic)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_bf16_is_as_accurate_as_the_unchunked_path(backward):
    torch.manual_seed(3)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16)
    hidden = (torch.randn(4, 16, HIDDEN) * 2).to(torch.bfloat16)
    labels = make_labels(seed=6, rows=4, length=16)
    settings = NTLSettings(variant="was", reweigh=True)
    head64 = torch.nn.Linear(HIDDEN, VOCAB, bias=False).double()
    head64.weight.data = head.weight.data.double()
    _, exact_loss, exact_grads = reference_and_grads(hidden.double(), head64, labels, settings)
    _, bf16_loss, bf16_grads = reference_and_grads(hidden, head, labels, settings)
    _, loss, grads = chunked_and_grads(hidden, head, labels, settings, 24, backward)
    assert grads[0].dtype == grads[1].dtype == torch.bfloat16
    assert relative_error(loss, exact_loss) <= 2 * relative_error(bf16_loss, exact_loss) + 1e-6
    for grad, bf16_grad, exact in zip(grads, bf16_grads, exact_grads):
        unchunked_error = relative_error(bf16_grad, exact)
        assert 0 < unchunked_error < 0.02
        assert relative_error(grad, exact) <= 2 * unchunked_error


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("chunks", [64, 128])
def test_bf16_weight_gradient_accumulates_in_float32(chunks, backward):
    """Many chunks add up the weight gradient: rounding it to bf16 after every chunk makes its error grow
    with the number of chunks (3.2x the unchunked head's at 64 chunks); a float32 accumulator does not."""
    torch.manual_seed(11)
    tokens, hidden_size, vocab = 8192, 64, 512
    vocab_ids = NumberVocab(tuple(range(200, 210)), tuple(float(v) for v in range(10)), vocab)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(torch.bfloat16)
    hidden = torch.randn(tokens, hidden_size).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,))
    labels[::4] = torch.randint(200, 210, (tokens // 4,))
    head64 = torch.nn.Linear(hidden_size, vocab, bias=False).double()
    head64.weight.data = head.weight.data.double()

    def weight_grad(module, run):
        module.zero_grad()
        sums = run(module)
        (sums.ce_sum / tokens + 0.3 * sums.ntl_sum / sums.ntl_count).backward()
        return module.weight.grad

    unchunked = lambda m: ce_ntl_sums(m(hidden.to(m.weight.dtype)), labels, vocab_ids)  # noqa: E731
    exact = weight_grad(head64, unchunked)
    unchunked_error = relative_error(weight_grad(head, unchunked), exact)
    chunked = weight_grad(head, lambda m: chunked_ce_ntl_sums(hidden, m, labels, vocab_ids,
                                                               chunk_tokens=tokens // chunks, backward=backward))
    assert chunked.dtype == torch.bfloat16
    assert 0 < unchunked_error < 0.02
    assert relative_error(chunked, exact) <= 1.5 * unchunked_error, (relative_error(chunked, exact), unchunked_error)


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("tied", [False, True])
def test_hf_model_forward_equals_logits_path(tied, backward):
    model = tiny_llama(VOCAB, seed=4, tie_word_embeddings=tied).double()
    input_ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(7))
    labels = make_labels(seed=8)
    settings = NTLSettings(variant="mse", reweigh=True)

    reference = ce_ntl_sums(model(input_ids=input_ids).logits, labels, number_vocab(), settings)
    combine(reference).backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    sums = chunked_model_ce_ntl_sums(model, model.get_output_embeddings(), {"input_ids": input_ids}, labels,
                                     number_vocab(), settings, chunk_tokens=6, backward=backward)
    combine(sums).backward()
    assert relative_error(combine(sums), combine(reference)) < 1e-12
    for name, p in model.named_parameters():
        assert relative_error(p.grad, ref_grads[name]) < 1e-10, name
    # the hooks are gone: the model computes logits again
    assert model(input_ids=input_ids).logits.shape == (2, 13, VOCAB)

    with torch.no_grad():  # evaluation: forward only
        evaluated = chunked_model_ce_ntl_sums(model, model.lm_head, {"input_ids": input_ids}, labels, number_vocab(),
                                              settings, chunk_tokens=5)
    assert not evaluated.ce_sum.requires_grad
    assert relative_error(evaluated.ce_sum, reference.ce_sum) < 1e-12
    assert relative_error(evaluated.ntl_sum, reference.ntl_sum) < 1e-12


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("backward", BACKWARDS)
def test_no_tensor_larger_than_a_chunk_of_logits(backward):
    torch.manual_seed(5)
    rows, vocab, chunk = 2 * 64, 512, 24
    head = torch.nn.Linear(HIDDEN, vocab, bias=False)
    hidden = torch.randn(2, 64, HIDDEN, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 64))
    labels[:, ::3] = torch.tensor(NUMBER_IDS)[torch.randint(0, 10, (labels[:, ::3].numel(),))].view(2, -1)
    vocab_ids = NumberVocab(tuple(NUMBER_IDS), tuple(float(v) for v in VALUES), vocab)
    for settings in (NTLSettings(), NTLSettings(variant="number_level", reweigh=True)):
        with _LargestTensor() as unchunked:
            sums = ce_ntl_sums(head(hidden), labels, vocab_ids, settings)
            (sums.ce_sum + sums.ntl_sum).backward()
        with _LargestTensor() as chunked:
            sums = chunked_ce_ntl_sums(hidden, head, labels, vocab_ids, settings, chunk_tokens=chunk,
                                       backward=backward)
            (sums.ce_sum + sums.ntl_sum).backward()
        assert unchunked.largest >= rows * vocab  # the detector sees the full logits when they exist
        # a backward vocabulary block of all rows holds as many logits as a forward chunk (128 x 96 = 24 x 512)
        assert chunked.largest == max(chunk * vocab, head.weight.numel())


def test_auto_backward_takes_vocab_blocks_for_small_chunks_only():
    cpu = ROWS_BACKWARD_MIN_CHUNK_TOKENS["cpu"]
    assert resolve_chunk_backward("auto", cpu, 4096, "cpu") == "rows"
    assert resolve_chunk_backward("auto", cpu - 1, 4096, "cpu") == "vocab_blocks"
    for device_type in ("cuda", "xpu"):  # accelerators: a higher FLOP/byte ratio, a larger crossover
        assert resolve_chunk_backward("auto", ROWS_BACKWARD_MIN_CHUNK_TOKENS_ACCELERATOR, 8192, device_type) == "rows"
        assert resolve_chunk_backward("auto", cpu, 8192, device_type) == "vocab_blocks"
    assert resolve_chunk_backward("auto", 20, 20, "cuda") == "rows"  # one chunk takes every row
    assert resolve_chunk_backward("rows", 9, 4096, "cpu") == "rows"
    assert resolve_chunk_backward("vocab_blocks", 4096, 4096, "cuda") == "vocab_blocks"


def test_errors_name_the_problem():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(2, 13, HIDDEN)
    labels = make_labels()
    for bad in (0, -4, True, 2.5):
        with pytest.raises(ValueError, match="chunk_tokens"):
            chunked_ce_ntl_sums(hidden, head, labels, number_vocab(), chunk_tokens=bad)
    with pytest.raises(ValueError, match="labels have shape"):
        chunked_ce_ntl_sums(hidden, head, labels[:, :-1], number_vocab(), chunk_tokens=4)
    with pytest.raises(ValueError, match="hidden size 8 does not match"):
        chunked_ce_ntl_sums(hidden[..., :8], head, labels, number_vocab(), chunk_tokens=4)
    with pytest.raises(ValueError, match=f"the LM head's weight rows hold {head.weight.shape[0]} vocabulary columns"):
        chunked_ce_ntl_sums(hidden, head, labels, number_vocab(), chunk_tokens=4,
                            shard=VocabShard(width=head.weight.shape[0] - 1))
    out_of_vocab = labels.clone()
    out_of_vocab[1, 5] = VOCAB + 2
    with pytest.raises(ValueError, match=f"label {VOCAB + 2} is outside the vocabulary"):
        chunked_ce_ntl_sums(hidden, head, out_of_vocab, number_vocab(), chunk_tokens=4)
    small_head = torch.nn.Linear(HIDDEN, 40, bias=False)
    with pytest.raises(ValueError, match="vocab_size=60"):
        chunked_ce_ntl_sums(hidden, small_head, labels.clamp(max=39), number_vocab(), chunk_tokens=4)

    with pytest.raises(ValueError, match="backward must be one of auto, rows, vocab_blocks, got 'columns'"):
        chunked_ce_ntl_sums(hidden, head, labels, number_vocab(), chunk_tokens=4, backward="columns")

    sums = chunked_ce_ntl_sums(hidden.requires_grad_(), head, labels, number_vocab(), chunk_tokens=4)
    loss = sums.ce_sum + sums.ntl_sum
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="single backward pass"):
        loss.backward()

    # a model that transforms its head's output (Gemma-2's final logit soft-capping) is refused
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32)
    gemma = Gemma2ForCausalLM(config)
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, 13))}
    with pytest.raises(ValueError, match="transforms its LM head's output"):
        chunked_model_ce_ntl_sums(gemma, gemma.lm_head, inputs, labels, number_vocab(), chunk_tokens=4)
    with pytest.raises(RuntimeError, match="was not called by the model's forward"):
        chunked_model_ce_ntl_sums(gemma, head, inputs, labels, number_vocab(), chunk_tokens=4)
    with pytest.raises(ValueError, match="do not pass labels to the model"):
        chunked_model_ce_ntl_sums(gemma, gemma.lm_head, {**inputs, "labels": labels}, labels, number_vocab(),
                                  chunk_tokens=4)
