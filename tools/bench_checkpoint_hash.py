#!/usr/bin/env python
"""What the checkpoint content hash costs: write shards the way a save does (torch.save + fsync), then hash
them the way the save does (`checkpoint.file_digest` in 1 MiB blocks, one file per process), with the
hash new manifests record (xxh3_128) and the one format-2 manifests recorded (sha256), in one run.

    python tools/bench_checkpoint_hash.py --gib 2 --files 2 --dir /path/on/the/checkpoint/filesystem

Prints the write time and, per algorithm, the hash time, its throughput and its share of the write (the
save also hashes in parallel over the ranks, each its share of the files), then sha256 / xxh3_128.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import torch  # noqa: E402

from ntl_pretrain.checkpoint import HASH_ALGORITHM, file_digest  # noqa: E402

OLD_ALGORITHM = "sha256"  # format 2


def _write(path: str, numel: int) -> float:
    """Seconds to save one shard and fsync it (its data made before the clock starts)."""
    shard = {"fp32_flat_groups": [torch.randn(numel)]}
    started = time.perf_counter()
    torch.save(shard, path)
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="total GiB written")
    parser.add_argument("--files", type=int, default=2, help="files (ranks) sharing it, written and hashed in parallel")
    parser.add_argument("--dir", default=None, help="folder on the file system to measure (default: a temp folder)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_hash_", dir=args.dir)
    numel = int(args.gib * 2**30 / 4 / args.files)
    paths = [os.path.join(folder, f"shard_{i}.pt") for i in range(args.files)]
    try:
        with ProcessPoolExecutor(args.files) as pool:
            write_s = max(pool.map(_write, paths, [numel] * args.files))  # the ranks write in parallel
            hash_s: dict[str, float] = {}
            for algorithm in (HASH_ALGORITHM, OLD_ALGORITHM, HASH_ALGORITHM):  # the new one before and after
                started = time.perf_counter()
                list(pool.map(file_digest, paths, [algorithm] * args.files))
                hash_s[algorithm] = max(hash_s.get(algorithm, 0.0), time.perf_counter() - started)  # the slower
        total = sum(os.path.getsize(p) for p in paths) / 2**30
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{total:.2f} GiB in {args.files} files: write+fsync {write_s:.2f} s")
    for algorithm, seconds in hash_s.items():
        print(f"  {algorithm:<9} {seconds:.2f} s ({total / seconds:.2f} GiB/s over {args.files} processes, "
              f"{seconds / total:.2f} s per GiB); hash / write = {seconds / write_s:.3f}")
    print(f"  {OLD_ALGORITHM} / {HASH_ALGORITHM} = {hash_s[OLD_ALGORITHM] / hash_s[HASH_ALGORITHM]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
