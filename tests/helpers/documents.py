"""Packed rows of several documents and their one-document-at-a-time references (data.document_mask): the
rows as the trainer's micro-batches hold them (`data.stream._to_micro_batch`: EOS after each document, the label
after an EOS ignored), and per document the plain model's logits and CE + NTL sums on that document alone."""

from __future__ import annotations

import numpy as np
import torch

from ntl_pretrain.data.stream import _to_micro_batch
from helpers.variants import ROW_LOCAL_OPTIONS, variant_settings
from ntl_pretrain.loss import VARIANTS, ce_ntl_sums

# Three documents a row, numbers at both ends of each (a number ends a document right before the next one starts
# with digits: the number-level spans must stop at the EOS), the rows' orders differing; the last one is cut.
DOCUMENTS = ["12+34=46", "7 apples cost 35.5$ or 9", "98-19=79 ok 5"]
ROW_ORDERS = [(0, 1, 2), (2, 0, 1)]
# every registered variant, with the options that keep its terms within a row (del's runs per row: runs over the
# flattened batch would join the documents, which one-by-one does not)
SETTINGS = {variant: variant_settings(variant, ROW_LOCAL_OPTIONS) for variant in VARIANTS}


def packed_rows(tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) `[2, seq_len]`: each row its documents' tokens, EOS after each, cut at seq_len + 1."""
    eos = tokenizer.eos_token_id
    samples = []
    for order in ROW_ORDERS:
        tokens = [t for k in order for t in tokenizer(DOCUMENTS[k], add_special_tokens=False)["input_ids"] + [eos]]
        assert len(tokens) > seq_len + 1, "the documents must fill the row"
        samples.append((np.array(tokens[:seq_len + 1]), None))
    batch = _to_micro_batch(samples, eos)
    return batch.input_ids, batch.labels


def document_slices(row: torch.Tensor, eos_id: int) -> list[slice]:
    """The positions of each document of one row of input ids (each ends with its EOS, the last may be cut)."""
    ends = [i + 1 for i, token in enumerate(row.tolist()) if token == eos_id]
    bounds = [0, *[e for e in ends if e < len(row)], len(row)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


@torch.no_grad()
def one_by_one(model, input_ids: torch.Tensor, labels: torch.Tensor, vocab, eos_id: int):
    """The plain model run on each document alone: (logits `[B, S, V]` put back in the rows' places, {name: (CE
    sum, NTL sum)} summed over the documents for CE with each of SETTINGS' variants)."""
    logits = torch.empty(*input_ids.shape, model.config.vocab_size)
    sums = {name: [0.0, 0.0] for name in SETTINGS}
    for b, row in enumerate(input_ids):
        for part in document_slices(row, eos_id):
            alone = model(input_ids=row[part].unsqueeze(0)).logits[0]
            logits[b, part] = alone
            for name, settings in SETTINGS.items():
                doc_sums = ce_ntl_sums(alone, labels[b, part], vocab, settings)
                sums[name][0] += float(doc_sums.ce_sum)
                sums[name][1] += float(doc_sums.ntl_sum)
    return logits, sums
