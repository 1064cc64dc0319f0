"""Digit-splitting tokenizer tooling for NTL: inspect, convert, train SentencePiece, resize embeddings.

The command-line front end is `tools/tokenizer.py`; docs/tokenizer.md is the user guide.
"""

from ntl_pretrain.tokenizer.analysis import VerificationReport, verify_conversion
from ntl_pretrain.tokenizer.inspect import InspectionReport, inspect_tokenizer
from ntl_pretrain.tokenizer.loading import TokenizerLoadError, load_tokenizer
from ntl_pretrain.tokenizer.resize import ResizeReport, resize_model, resize_model_embeddings
from ntl_pretrain.tokenizer.split_digits import (ConversionCheckError, SplitDigitsReport, is_digit_level,
                                                 plan_digit_split, split_digits)
from ntl_pretrain.tokenizer.spm import SpmTrainConfig, SpmTrainReport, train_spm

__all__ = [
    "ConversionCheckError", "InspectionReport", "ResizeReport", "SpmTrainConfig", "SpmTrainReport",
    "SplitDigitsReport", "TokenizerLoadError", "VerificationReport", "inspect_tokenizer", "is_digit_level",
    "load_tokenizer", "plan_digit_split", "resize_model", "resize_model_embeddings", "split_digits", "train_spm",
    "verify_conversion",
]
