"""Checkpoints: DeepSpeed's tensor-sharded save/load made safe for long runs on clusters that pre-empt.

Layout of a run folder (`train.output_dir`):

    global_step300/              one DeepSpeed checkpoint (one file set per ZeRO partition and TP rank)
      zero_pp_rank_*_mp_rank_*_{model,optim}_states.pt
      rng_state_<rank>.pt        python / numpy / torch (/ accelerator) RNG of each global rank
      hf/                        config.json, generation_config.json, tokenizer, number_vocab.json (export)
      ntl_checkpoint.json        the manifest: written last, so a folder without it is incomplete
      KEEP                       (optional, made by hand) never deleted by keep-last-K
    global_step300_universal/    DeepSpeed universal form of it (resharding), made on demand
    latest                       the newest complete tag (DeepSpeed's pointer file, replaced atomically)

Atomicity: every rank writes into `global_stepN.partial` (marked as ours by a `.ntl_staging` file);
when all ranks have finished, the ranks hash the files (xxh3_128, each rank a share), global rank 0
lists them with their sizes and hashes in the manifest, renames the folder to `global_stepN` (an atomic
rename) and then replaces `latest` (with checkpoint.async_save the files are written and hashed by a
background thread from a snapshot in host memory, and the ranks commit together at a later step
boundary: `async_save`). A save killed at any point leaves at most a `.partial` folder,
which no resume picks; the next save removes it (only folders carrying the marker). A resume checks
the manifest (every file present with its recorded size and content hash, so a truncated or corrupted
shard is caught before DeepSpeed reads it), the fingerprint (model config, tokenizer, number
vocabulary, data configuration), the learning-rate schedule and the layout (dp, tp, ZeRO stage); a
different layout is loaded through a universal checkpoint (`deepspeed.checkpoint.ds_to_universal`).

Every load of a checkpoint file (ours, DeepSpeed's engine and its universal conversion) unpickles with
`torch.load(weights_only=True)` and an allow-list of the few DeepSpeed classes its files hold
(`weights_only_loads`), so a crafted pickle cannot run code; docs/checkpoints.md says what trusting a
checkpoint folder still means.

Modules (each imports only those above it):
    format        names, the manifest, error types, the saved layout
    collective    rank 0 acts / shares of files / errors agreed over the ranks
    safe_loading  weights-only loads, RNG state
    integrity     content hashes, verification of a folder
    fingerprint   model, tokenizer, number vocabulary, data and LR-schedule descriptions
    staging       temporary folders of ours, cleanup of interrupted saves
    async_save    snapshots of DeepSpeed's files in host memory, written and hashed by a background thread
    universal     conversion to DeepSpeed's universal form (resharding)
    export        Hugging Face export
    manager       choosing the resume checkpoint; CheckpointManager (save, load, keep-last-K, resume planning)
"""

from .collective import run_on_main
from .export import export_hf, write_hf_assets
from .fingerprint import fingerprint, lr_schedule_description
from .format import (HF_DIR, LATEST_NAME, MANIFEST_NAME, AgreedCheckpointError, CheckpointError, CheckpointInfo,
                     SavedLayout, UnsafeCheckpointError, folder_bytes, read_manifest, step_of_tag, tag_for_step)
from .integrity import HASH_ALGORITHM, file_digest, hash_files, verify_checkpoint
from .manager import CheckpointManager, list_checkpoints, resolve_resume
from .safe_loading import load_rng_state, safe_load, seed_generators, weights_only_loads
from .staging import make_staging, remove_interrupted_saves, remove_staging
from .universal import convert_to_universal, universal_path

__all__ = [
    "HASH_ALGORITHM", "HF_DIR", "LATEST_NAME", "MANIFEST_NAME", "AgreedCheckpointError", "CheckpointError",
    "CheckpointInfo", "CheckpointManager", "SavedLayout", "UnsafeCheckpointError", "convert_to_universal",
    "export_hf", "file_digest", "fingerprint", "folder_bytes", "hash_files", "list_checkpoints",
    "load_rng_state", "lr_schedule_description", "make_staging", "read_manifest", "remove_interrupted_saves",
    "remove_staging", "resolve_resume", "run_on_main", "safe_load", "seed_generators", "step_of_tag", "tag_for_step",
    "universal_path", "verify_checkpoint", "weights_only_loads", "write_hf_assets",
]
