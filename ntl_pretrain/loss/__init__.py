"""Cross-entropy + Number Token Loss, on one device or on vocabulary-parallel logit shards."""

from .chunked import chunked_ce_ntl_sums, chunked_model_ce_ntl_sums
from .compat import NTLoss, NTLossDotProduct, NumberLevelLoss
from .hf_trainer import HFTrainerLoss, without_targets_after_padding
from .normalize import StepCounts, count_step, scaled_micro_batch_loss
from .ntl import VARIANTS, NTLSettings
from .objective import ObjectiveSums, ce_ntl_loss, ce_ntl_sums, number_token_loss
from .parallel import shard_reductions
from .shard import VocabShard, vocab_shard_of

__all__ = [
    "VARIANTS", "HFTrainerLoss", "NTLSettings", "NTLoss", "NTLossDotProduct", "NumberLevelLoss", "ObjectiveSums",
    "StepCounts", "VocabShard", "ce_ntl_loss", "ce_ntl_sums", "chunked_ce_ntl_sums", "chunked_model_ce_ntl_sums", "count_step",
    "number_token_loss", "scaled_micro_batch_loss", "shard_reductions", "vocab_shard_of", "without_targets_after_padding",
]
