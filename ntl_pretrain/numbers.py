"""The number vocabulary under its public name (`from ntl_pretrain.numbers import NumberVocab`); it lives in
`ntl_pretrain.core.numbers`, the bottom layer that the loss and the tokenizer share."""

from .core.numbers import (DIGITS, NUMBER_VOCAB_FILENAME, DigitsNotKeptError,  # noqa: F401 (the public names)
                           NumberTokenError, NumberVocab, digit_hiding_added_tokens)
