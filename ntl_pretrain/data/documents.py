"""Where each document of a packed row starts: the position ids that restart at every document
(`document_position_ids`), from which transformers and DeepSpeed's Ulysses attention keep attention inside a
document (`data.document_mask`, docs/training.md "Packing").

Packing puts an EOS token after every document (`sources`), so a document starts at a row's first token or
right after an EOS. As Megatron's `get_ltor_masks_and_position_ids` (`--reset-position-ids
--reset-attention-mask`) the EOS keeps the position of the document it ends and the next token is position 0;
the first document of a row, usually the rest of one cut at the previous row's end, starts at 0 too. Computed
on the device from the row itself (a running maximum, no host sync), so the data stream, the prepared format
and a resume's state are the same with the mode on or off."""

from __future__ import annotations

import torch


def document_position_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """`[B, S]` position ids of packed rows `input_ids` `[B, S]`: each token's offset from the start of its
    document (the row's start or the token after an EOS)."""
    length = input_ids.shape[-1]
    index = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[..., 1:] = input_ids[..., :-1] == eos_id
    starts[..., 0] = True
    # the index of each token's document start: the latest start at or before it
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first
