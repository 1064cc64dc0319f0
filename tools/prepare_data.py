#!/usr/bin/env python
"""Tokenize and pack a config's data sources once, into folders every node memory-maps (format: prepared).

    python tools/prepare_data.py --config configs/qwen2.5_0.5b_cpt.yaml --out /data/prepared/cpt --num-proc 16

Each source of `data.sources` becomes OUT/source-I: its training and validation samples (`datasets`
save_to_disk: Arrow files, memory-mapped by every rank) and a manifest.json of what made them (tokenizer
fingerprint, seq_len, the held-out count, the document size limit, the source's fields and prompt template,
its files and their sizes). Train from them with
`data.sources=[{path: OUT/source-0, format: prepared, weight: W}, ...]`: no tokenization at start-up; a
corpus made with another tokenizer or other settings is refused, every differing key named. Streamed sources
are read whole here. Settings come from the config (and `key=value` overrides), as for a run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from ntl_pretrain.config import ConfigError, load_config  # noqa: E402
from ntl_pretrain.data import DataError  # noqa: E402
from ntl_pretrain.data.prepared import prepare_corpus  # noqa: E402
from ntl_pretrain.models.build import load_run_tokenizer  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/prepare_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a training config (its data and tokenizer sections)")
    parser.add_argument("--out", required=True, help="folder to write OUT/source-I into (each must not exist)")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizing processes (default data.num_proc)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not sys.stderr.isatty():  # progress bars on a terminal only; a log gets a progress line every 60 s
        import datasets

        datasets.disable_progress_bars()
    started = time.perf_counter()
    try:
        cfg = load_config(args.config, list(args.overrides))
        num_proc = args.num_proc or cfg.data.num_proc
        if num_proc < 1:
            raise ConfigError(f"--num-proc must be >= 1, got {num_proc}")
        tokenizer = load_run_tokenizer(cfg.tokenizer, cfg.model)
        folders = prepare_corpus(cfg.data, tokenizer, args.out, num_proc)
    except FileExistsError as error:
        print(f"error: {error}; choose another --out or delete it", file=sys.stderr, flush=True)
        return 2
    except (ConfigError, DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    print(f"prepared {len(folders)} source(s) in {time.perf_counter() - started:.1f} s; train from them with:")
    print("data.sources=[" + ", ".join(  # the label too: data.stages may name the sources by it (keep data.stages)
        f"{{path: {folder}, format: prepared, weight: {source.weight}"
        f"{f', label: {source.label}' if source.label else ''}}}" for folder, source in zip(folders, cfg.data.sources))
        + "]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
