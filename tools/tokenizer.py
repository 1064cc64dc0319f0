#!/usr/bin/env python
"""Digit-splitting tokenizer tooling for Number Token Loss training.

  inspect        how a tokenizer splits numbers, its digit tokens, NTL's number vocabulary, a verdict
  split-digits   rewrite a fast tokenizer so every digit is its own token, verify it, save it
  train-spm      train a SentencePiece tokenizer with split_digits and byte fallback (HF folder)
  resize-model   grow a model's embeddings to a tokenizer that gained tokens, save model + tokenizer
  number-vocab   write the number vocabulary (number_vocab.json) the trainer reads

Run `python tools/tokenizer.py COMMAND --help` for each command's options; docs/tokenizer.md explains them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Runs from a checkout without installation too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntl_pretrain.core.fs import STANDARD_STREAMS  # noqa: E402
from ntl_pretrain.numbers import NUMBER_VOCAB_FILENAME, NumberVocab  # noqa: E402
from ntl_pretrain.tokenizer import (ConversionCheckError, SpmTrainConfig,  # noqa: E402
                                    inspect_tokenizer, load_tokenizer, resize_model, split_digits, train_spm)


def _cmd_inspect(args: argparse.Namespace) -> int:
    report = inspect_tokenizer(load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code),
                               source=args.tokenizer)
    print(report.to_json() if args.json else report.format())
    return 0


def _progress_line():
    """Print each phase of a long command on stderr with the seconds since the command started (stdout keeps the
    report, or the JSON)."""
    import time

    start = time.monotonic()
    return lambda message: print(f"[{time.monotonic() - start:6.1f} s] {message}", file=sys.stderr, flush=True)


def _cmd_split_digits(args: argparse.Namespace) -> int:
    try:
        report = split_digits(args.tokenizer, args.out, corpus=args.corpus, force=args.force,
                              trust_remote_code=args.trust_remote_code, progress=_progress_line())
    except ConversionCheckError as error:
        if args.json:
            print(json.dumps({"passed": False, "verification": error.report.to_dict()}, indent=1, ensure_ascii=False))
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) if args.json else report.format())
    return 0


def _cmd_train_spm(args: argparse.Namespace) -> int:
    config = SpmTrainConfig(vocab_size=args.vocab_size, model_type=args.model_type,
                            character_coverage=args.character_coverage, normalization=args.normalization,
                            max_sentences=args.max_sentences, num_threads=args.num_threads)
    report = train_spm(args.corpus, args.out, config, force=args.force)
    print(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) if args.json else report.format())
    return 0


def _cmd_resize_model(args: argparse.Namespace) -> int:
    report, number_vocab_path = resize_model(args.model, args.tokenizer, args.out, args.pad_to_multiple_of,
                                             init=args.init, force=args.force,
                                             trust_remote_code=args.trust_remote_code)
    if args.json:
        print(json.dumps({**report.to_dict(), "number_vocab": number_vocab_path}, indent=1))
    else:
        print(report.format())
        print(f"saved model and tokenizer to {args.out}"
              + (f"; number vocabulary: {number_vocab_path}" if number_vocab_path else
                 "; no number vocabulary (the tokenizer lacks digit tokens: run split-digits first)"))
    return 0


def _check_replaceable_vocab(path: str) -> None:
    """Refuse to write over anything but an earlier number vocabulary: `--out model/config.json` replaced the
    model's config without a word, and a link in its place was replaced by a file."""
    if not os.path.lexists(path) or path in STANDARD_STREAMS:  # the stream is written, nothing replaced
        return
    if os.path.islink(path) or not os.path.isfile(path):
        raise ValueError(f"--out {path!r} exists and is {'a symbolic link' if os.path.islink(path) else 'not a file'}; "
                         f"choose another path (nothing was written)")
    try:
        with open(path, encoding="utf-8") as handle:
            earlier = json.load(handle)
    except (OSError, ValueError):
        earlier = None
    if not (isinstance(earlier, dict) and {"token_ids", "values"} <= set(earlier)):
        raise ValueError(f"--out {path!r} exists and is not a number vocabulary, so it is not replaced; choose "
                         f"another path, or remove it first (nothing was written)")


def _cmd_number_vocab(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
    vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=not args.multi_digit, vocab_size=args.vocab_size)
    out = args.out
    if out is None:
        source = Path(args.tokenizer)
        if not source.exists():
            raise ValueError(f"{args.tokenizer!r} is not a local tokenizer; say where to write with --out FILE")
        out = str(source if source.is_dir() else source.parent)
    _check_replaceable_vocab(os.path.join(out, NUMBER_VOCAB_FILENAME) if os.path.isdir(out) else out)
    if vocab.digit_level and not args.allow_non_digit_level:
        # the verdict `inspect` prints: a digit-level vocabulary of a tokenizer that keeps digits together gives NTL
        # only the numbers that happen to be one digit (the trainer refuses that pairing at start-up too)
        report = inspect_tokenizer(tokenizer, source=args.tokenizer)
        if not report.digit_level:
            raise ValueError(f"{args.tokenizer} is NOT digit-level ({report.problems[0]}): a digit-level number "
                             f"vocabulary would leave most numbers out of NTL; run tools/tokenizer.py split-digits "
                             f"{args.tokenizer} OUT first, or write every number token with --multi-digit, or pass "
                             f"--allow-non-digit-level to write the ten digits anyway")
    if os.path.isdir(out) or out.endswith(os.sep):
        os.makedirs(out, exist_ok=True)
    path = vocab.save(out)
    if args.json:
        print(json.dumps({**vocab.to_dict(), "path": path}, indent=1, ensure_ascii=False))
    else:
        pairs = ", ".join(f"{t}={i}" for t, i in zip(vocab.tokens, vocab.token_ids))
        print(f"number vocabulary ({'digit-level' if vocab.digit_level else 'multi-digit'}, K={len(vocab)}, "
              f"vocab_size={vocab.vocab_size}) written to {path}")
        print(f"  {pairs if len(vocab) <= 40 else pairs[:400] + ' ...'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenizer.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    source_help = ("a tokenizer folder, a tokenizer.json, a SentencePiece .model file, a tiktoken BPE file (Meta's "
                   "Llama-3 tokenizer.model, *.tiktoken) or a Hugging Face Hub id")

    def add_common(sub: argparse.ArgumentParser, json_help: str = "print JSON instead of text") -> None:
        sub.add_argument("--json", action="store_true", help=json_help)
        sub.add_argument("--trust-remote-code", action="store_true",
                         help="allow tokenizer code from the Hub (off by default)")

    sub = commands.add_parser("inspect", help="how a tokenizer splits numbers, and whether NTL can use it")
    sub.add_argument("tokenizer", metavar="TOKENIZER", help=source_help)
    add_common(sub)
    sub.set_defaults(run=_cmd_inspect)

    sub = commands.add_parser("split-digits", help="rewrite a fast tokenizer to one token per digit, verified")
    sub.add_argument("tokenizer", metavar="TOKENIZER", help=source_help)
    sub.add_argument("out", metavar="OUT", help="new folder for the converted tokenizer")
    sub.add_argument("--corpus", metavar="FILE", help="text or .jsonl file to verify on (default: built-in sample)")
    sub.add_argument("--force", action="store_true", help="replace OUT if it exists")
    add_common(sub)
    sub.set_defaults(run=_cmd_split_digits)

    sub = commands.add_parser("train-spm", help="train a digit-level SentencePiece tokenizer (HF folder)")
    sub.add_argument("corpus", metavar="CORPUS", nargs="+", help="text or .jsonl files")
    sub.add_argument("out", metavar="OUT", help="new folder for the tokenizer")
    defaults = SpmTrainConfig()
    sub.add_argument("--vocab-size", type=int, required=True, help="number of pieces (>= 270)")
    sub.add_argument("--model-type", choices=("bpe", "unigram"), default=defaults.model_type)
    sub.add_argument("--character-coverage", type=float, default=defaults.character_coverage,
                     help=f"share of characters with their own piece (default {defaults.character_coverage})")
    sub.add_argument("--normalization", default=defaults.normalization,
                     help=f"SentencePiece normalization rule (default {defaults.normalization}: text kept verbatim)")
    sub.add_argument("--max-sentences", type=int, default=defaults.max_sentences,
                     help=f"lines sampled for training, 0 = all (default {defaults.max_sentences})")
    sub.add_argument("--num-threads", type=int, default=defaults.num_threads, help="0 = all cores")
    sub.add_argument("--force", action="store_true", help="replace OUT if it exists")
    sub.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub.set_defaults(run=_cmd_train_spm)

    sub = commands.add_parser("resize-model", help="resize a model's embeddings to its new tokenizer")
    sub.add_argument("model", metavar="MODEL", help="model folder or Hub id (AutoModelForCausalLM)")
    sub.add_argument("tokenizer", metavar="TOKENIZER", help=source_help)
    sub.add_argument("out", metavar="OUT", help="new folder for the resized model and the tokenizer")
    sub.add_argument("--pad-to-multiple-of", type=int, default=64,
                     help="rows become a multiple of this; make it divisible by the tensor-parallel size (default 64)")
    sub.add_argument("--init", choices=("mean", "model"), default="mean",
                     help="new rows: mean of existing rows and digit spellings (default), or the model's initialiser")
    sub.add_argument("--force", action="store_true", help="replace OUT if it exists")
    add_common(sub)
    sub.set_defaults(run=_cmd_resize_model)

    sub = commands.add_parser("number-vocab", help="write number_vocab.json, the number tokens NTL uses")
    sub.add_argument("tokenizer", metavar="TOKENIZER", help=source_help)
    sub.add_argument("--out", metavar="PATH", help="file or folder to write (default: the tokenizer's folder)")
    sub.add_argument("--multi-digit", action="store_true",
                     help="every token that parses as a number, not just '0'..'9'")
    sub.add_argument("--vocab-size", type=int, help="the model's (padded) vocabulary size; default len(tokenizer)")
    sub.add_argument("--allow-non-digit-level", action="store_true",
                     help="write the ten digits although `inspect` finds the tokenizer NOT digit-level (refused "
                          "otherwise; the trainer's tokenizer.allow_non_digit_level is the same override)")
    add_common(sub)
    sub.set_defaults(run=_cmd_number_vocab)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError, RuntimeError) as error:  # user-caused problems; messages name the fix
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
