"""The `del` NTL variant (the Digit Entropy Loss as its authors define it): its place weights on hand-worked runs,
against a plain-torch reference (tests/helpers/del_reference.py) on the full logits, the chunked head and sequence
slices, its settings, config keys and vocabulary checks (vocabulary shards, like every variant's:
tests/test_loss_variants.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.del_reference import del_place_weights, del_reference
from helpers.numeric import relative_error
from ntl_pretrain.config import ConfigError, load_config
from ntl_pretrain.config.validation import ntl_settings
from ntl_pretrain.loss import VARIANTS, NTLSettings, ce_ntl_loss, ce_ntl_sums, number_token_loss
from ntl_pretrain.loss.chunked import chunked_ce_ntl_sums
from ntl_pretrain.loss.sequence_shard import SequenceShard, shard_number_spans
from ntl_pretrain.loss.variants.del_loss import place_weight, run_spans
from ntl_pretrain.numbers import NumberVocab

VOCAB_SIZE = 40
DIGIT_IDS = [21, 4, 33, 9, 17, 28, 2, 36, 12, 25]  # digit d is token DIGIT_IDS[d]: ids out of value order
DOT_ID = 30
SETTINGS = NTLSettings(variant="del")
CONFIG = ["model.architecture={model_type: llama}", "tokenizer.name_or_path=x", "data.sources=[{path: corpus.jsonl}]"]


def _vocab() -> NumberVocab:
    order = sorted(range(10), key=lambda d: DIGIT_IDS[d])
    return NumberVocab(tuple(DIGIT_IDS[d] for d in order), tuple(float(d) for d in order), VOCAB_SIZE,
                       decimal_point_id=DOT_ID)


def _encode(text: str) -> list[int]:
    """'0'..'9' digits, '.' the decimal point, '_' an ignored label, anything else a word token."""
    return [-100 if c == "_" else DOT_ID if c == "." else DIGIT_IDS[int(c)] if c.isdigit() else 1 for c in text]


def _batch(seed: int = 0, rows: int = 3, length: int = 24, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, length, VOCAB_SIZE, generator=generator) * 3).to(dtype)
    labels = torch.randint(0, VOCAB_SIZE, (rows, length), generator=generator)
    numbers = torch.rand(rows, length, generator=generator) < 0.6  # runs of digits and '.'
    symbols = torch.tensor(DIGIT_IDS + [DOT_ID, DOT_ID])
    labels[numbers] = symbols[torch.randint(0, 12, (int(numbers.sum()),), generator=generator)]
    labels[0, :3] = -100
    labels[1] = torch.tensor(_encode("a 7_31.25 b 1.2.3 .5.4 6"))  # a run across an ignored label, decimals
    labels[2, :2] = torch.tensor(_encode("89"))  # row 1 ends in digits and row 2 starts with them
    labels[2, 11:16] = torch.tensor(_encode("40.25"))  # a decimal number across the middle (sp = 2)
    weights = torch.rand(rows, length, generator=generator, dtype=dtype)
    return logits, labels, weights


@pytest.mark.fast
def test_it_is_registered_and_the_config_takes_its_keys():
    assert "del" in VARIANTS and "digit_entropy" in VARIANTS
    config = load_config(None, CONFIG + ["loss.variant=del", "loss.ntl_weight=1", "loss.del_scale=0.1",
                                         "loss.del_runs=rows"])
    assert ntl_settings(config.loss) == NTLSettings(variant="del", del_scale=0.1, del_runs="rows")
    assert SETTINGS.describe() == "variant=del, reweigh=False, del_scale=0.01, del_runs=batch"
    with pytest.raises(ConfigError, match=r"loss.del_runs='row' is not one of batch, rows"):
        load_config(None, CONFIG + ["loss.variant=del", "loss.del_runs=row"])
    with pytest.raises(ConfigError, match=r"del_scale applies to variant 'del' only, not 'was'"):
        ntl_settings(load_config(None, CONFIG + ["loss.del_scale=0.1"]).loss)
    with pytest.raises(ConfigError, match=r"loss.variant=del scores each digit position over the ten single-digit "
                                          r"tokens and needs tokenizer.digit_level=true"):
        load_config(None, CONFIG + ["loss.variant=del", "tokenizer.digit_level=false"])


@pytest.mark.fast
@pytest.mark.parametrize("text,expected", [
    ("305", [6.0, 4.0, 2.0]),  # 2 (p + 1) for the digit of power p
    ("3.25", [2.0, None, 1.02 ** -2, 1.02 ** -3]),  # the k-th decimal: 1.02 ** -(k + 1)
    ("7.", [2.0, None]),
    (".5", [None, 2.0]),  # a leading '.' is no decimal point
    (".5.4", [None, 6.0, None, 2.0]),  # ... and the places count every label of the run, as the authors' code does
    ("1.2.3", [2.0, None, 1.02 ** -2, None, 1.02 ** -4]),  # the first '.' is the point
])
def test_place_weights_of_hand_worked_runs(text, expected):
    assert del_place_weights(list(text)) == pytest.approx(expected)
    labels = torch.tensor([_encode("a " + text + " b")])
    slot = _vocab().index_of(labels.reshape(-1))
    spans = run_spans(slot, labels, DOT_ID, -100, "batch")
    ours = place_weight(spans.place, torch.float64)[2:2 + len(text)]
    assert [None if c == "." else float(w) for c, w in zip(text, ours)] == pytest.approx(expected)


@pytest.mark.fast
def test_runs_over_the_flattened_batch_or_per_row():
    labels = torch.tensor([_encode("xy 12"), _encode("3_4 y")])
    slot = _vocab().index_of(labels.reshape(-1))
    batch = place_weight(run_spans(slot, labels, DOT_ID, -100, "batch").place, torch.float64).view(2, -1)
    rows = place_weight(run_spans(slot, labels, DOT_ID, -100, "rows").place, torch.float64).view(2, -1)
    assert batch[0, 3:].tolist() == [8.0, 6.0] and batch[1, [0, 2]].tolist() == [4.0, 2.0]  # one run "1234"
    assert rows[0, 3:].tolist() == [4.0, 2.0] and rows[1, [0, 2]].tolist() == [2.0, 2.0]  # "12", "3", "4"


@pytest.mark.fast
@pytest.mark.parametrize("runs", ["batch", "rows"])
@pytest.mark.parametrize("weighted", [False, True])
def test_equals_the_plain_torch_reference_with_its_gradient(runs, weighted):
    logits, labels, weights = _batch()
    loss_weights = weights if weighted else None
    ours_logits = logits.clone().requires_grad_()
    ours = number_token_loss(ours_logits, labels, _vocab(), variant="del", del_runs=runs, del_scale=0.1,
                             loss_weights=loss_weights)
    reference_logits = logits.clone().requires_grad_()
    total, count = del_reference(reference_logits, labels, DIGIT_IDS, DOT_ID, scale=0.1, runs=runs,
                                 loss_weights=loss_weights)
    reference = total / count
    assert relative_error(ours, reference) <= 1e-12, (ours, reference)
    ours_grad, = torch.autograd.grad(ours, ours_logits)
    reference_grad, = torch.autograd.grad(reference, reference_logits)
    assert relative_error(ours_grad, reference_grad) <= 1e-10
    # through the CE + NTL objective, in float32, to 1e-6 in value and gradient
    settings = NTLSettings(variant="del", del_runs=runs, del_scale=0.1)
    float_logits = logits.float().requires_grad_()
    sums = ce_ntl_sums(float_logits, labels, _vocab(), settings, loss_weights=loss_weights)
    assert relative_error(sums.ntl_sum, total) <= 1e-6 and relative_error(sums.ntl_count, count) <= 1e-6
    float_grad, = torch.autograd.grad(sums.ntl_sum, float_logits)
    reference_sum_logits = logits.clone().requires_grad_()
    reference_sum, _ = del_reference(reference_sum_logits, labels, DIGIT_IDS, DOT_ID, scale=0.1, runs=runs,
                                     loss_weights=loss_weights)
    reference_sum_grad, = torch.autograd.grad(reference_sum, reference_sum_logits)
    assert relative_error(float_grad, reference_sum_grad) <= 1e-6


@pytest.mark.fast
def test_the_authors_normalisation_and_constants():
    # unweighted, the mean is c x the mean over the N x 10 entries; c = 0.1 is ten times c = 0.01 (the default)
    logits, labels, _ = _batch(seed=3)
    default = number_token_loss(logits, labels, _vocab(), variant="del")
    assert relative_error(number_token_loss(logits, labels, _vocab(), variant="del", del_scale=0.1),
                          10 * default) <= 1e-12
    # one digit "7" alone: 0.01 x the mean of its ten entries 2 * q_k * BCEWithLogits(z_k, [k = 7])
    one = torch.randn(1, 1, VOCAB_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    z = one[0, 0, DIGIT_IDS]
    entries = 2 * torch.softmax(z, -1) * torch.nn.functional.binary_cross_entropy_with_logits(
        z, torch.nn.functional.one_hot(torch.tensor(7), 10).double(), reduction="none")
    assert relative_error(number_token_loss(one, torch.tensor([[DIGIT_IDS[7]]]), _vocab(), variant="del"),
                          0.01 * entries.mean()) <= 1e-12


@pytest.mark.fast
@pytest.mark.parametrize("backward", ["rows", "vocab_blocks"])
def test_chunked_head_equals_full_logits(backward):
    generator = torch.Generator().manual_seed(1)
    _, labels, weights = _batch(seed=1)
    hidden = torch.randn(*labels.shape, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, VOCAB_SIZE, bias=False, dtype=torch.float64)
    full = ce_ntl_sums(head(hidden), labels, _vocab(), SETTINGS, loss_weights=weights)
    full_grads = torch.autograd.grad(full.ce_sum + full.ntl_sum, (hidden, head.weight))
    chunked = chunked_ce_ntl_sums(hidden, head, labels, _vocab(), SETTINGS, chunk_tokens=7, loss_weights=weights,
                                  backward=backward)
    chunked_grads = torch.autograd.grad(chunked.ce_sum + chunked.ntl_sum, (hidden, head.weight))
    assert relative_error(chunked.stack(), full.stack()) <= 1e-12
    assert max(relative_error(a, b) for a, b in zip(chunked_grads, full_grads)) <= 1e-12
    reference, _ = del_reference(head(hidden).detach(), labels, DIGIT_IDS, DOT_ID, loss_weights=weights)
    assert relative_error(chunked.ntl_sum, reference) <= 1e-12


@pytest.mark.fast
@pytest.mark.parametrize("runs", ["batch", "rows"])
def test_sequence_slices_with_the_whole_batch_spans_add_up_to_the_reference(runs):
    # sp = 2 as the trainer runs it: each rank the whole micro-batch's spans (shard_number_spans), its slice's logits
    logits, labels, _ = _batch(seed=2, length=24)
    assert int(labels[2, 11]) in DIGIT_IDS and int(labels[2, 13]) == DOT_ID  # "40.25" crosses the cut at 12
    settings = NTLSettings(variant="del", del_runs=runs)
    reference_logits = logits.clone().requires_grad_()
    reference, count = del_reference(reference_logits, labels, DIGIT_IDS, DOT_ID, runs=runs)
    reference_grad, = torch.autograd.grad(reference, reference_logits)
    parts, grads = [], []
    for rank in range(2):
        shard = SequenceShard(rank=rank, size=2)
        spans = shard_number_spans(labels, shard, _vocab(), settings)
        local = shard.split(logits).requires_grad_()
        part = ce_ntl_sums(local, shard.split(labels), _vocab(), settings, spans=spans)
        grads.append(torch.autograd.grad(part.ntl_sum, local)[0])
        parts.append(part)
    assert relative_error(sum(part.ntl_sum for part in parts), reference) <= 1e-12
    assert relative_error(sum(part.ntl_count for part in parts), count) <= 1e-12
    assert relative_error(torch.cat(grads, dim=1), reference_grad) <= 1e-12


@pytest.mark.fast
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_host_sync_in_a_training_call(variant):
    # what the trainer calls after its first micro-batch (check_inputs=False): the runs, places and terms, forward
    # and backward, and a sequence shard's spans, read nothing on the host (counted as on a GPU)
    from helpers.sync_counter import SyncCounter

    settings = NTLSettings(variant=variant)
    logits, labels, _ = _batch(seed=5, dtype=torch.float32)
    logits.requires_grad_()
    with SyncCounter() as counter:
        sums = ce_ntl_sums(logits, labels, _vocab(), settings, check_inputs=False)
        (sums.ce_sum + sums.ntl_sum).backward()
        shard = SequenceShard(rank=1, size=2)
        spans = shard_number_spans(labels, shard, _vocab(), settings)
        if spans.combine is None:  # a variant whose slices exchange their numbers (number_level) needs a group
            ce_ntl_sums(shard.split(logits.detach()), shard.split(labels), _vocab(), settings, check_inputs=False,
                        spans=spans)
    assert not counter.by_package, counter.summary()


@pytest.mark.fast
def test_settings_and_vocabulary_it_refuses():
    with pytest.raises(ValueError, match="reweigh does not apply to variant 'del'"):
        NTLSettings(variant="del", reweigh=True)
    with pytest.raises(ValueError, match=r"del_scale must be > 0 and finite"):
        NTLSettings(variant="del", del_scale=0.0)
    with pytest.raises(ValueError, match=r"del_runs must be one of batch, rows .* got 'row'"):
        NTLSettings(variant="del", del_runs="row")
    with pytest.raises(ValueError, match=r"del_runs applies to variant 'del' only, not 'digit_entropy'"):
        NTLSettings(variant="digit_entropy", del_runs="rows")
    logits, labels, _ = _batch()
    no_dot = NumberVocab(_vocab().token_ids, _vocab().values, VOCAB_SIZE)
    with pytest.raises(ValueError, match=r"variant 'del' reads decimals after a '.' and needs the '.' token id"):
        ce_ntl_loss(logits, labels, no_dot, settings=SETTINGS)
    multi_digit = NumberVocab((3, 4, 5), (1.0, 12.0, 7.0), VOCAB_SIZE, tokens=("1", "12", "7"), decimal_point_id=30)
    with pytest.raises(ValueError, match=r"variant 'del' scores each digit position over the ten single-digit tokens, "
                                         r"but the number vocabulary holds 1 other number tokens"):
        ce_ntl_loss(logits, labels, multi_digit, settings=SETTINGS)


@pytest.mark.fast
def test_a_config_with_del_passes_the_dry_run_and_names_its_weight(dry_run_here):
    result = dry_run_here("--config", "configs/demo.yaml", "--world-size", "1", "loss.variant=del",
                          "loss.ntl_weight=1", "loss.del_scale=0.1")
    assert result.returncode == 0, result.stderr
    assert "# objective: CE + 1 x NTL (variant=del, reweigh=False, del_scale=0.1, del_runs=batch; constant)" in (
        result.stdout)
