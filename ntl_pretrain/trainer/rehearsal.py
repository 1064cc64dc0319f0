"""A rehearsal of a run's start-up at full size in one process: every rank of an N-rank world goes through the
project's start-up path on torch's fake process-group backend (no communication) with the model on the meta
device (no weights, no compute), and what each rank would hold is checked to add up.

For each simulated global rank r (`rehearse`): the fake process group of rank r of N (torch's
`torch.testing._internal.distributed.fake_pg`: collectives return at once, groups are real objects with real
ranks), the launcher's environment (RANK, LOCAL_RANK, ...), then, as the trainer runs them:

    start-up step (trainer)                                  what the rank gets (project function called)
    config checks (`preflight.preflight`, once: no rank)    the resolved config and DeepSpeed config
    layout (`distributed.layout`)                           dp / sp / tp ranks, from dist.get_rank()
    DeepSpeed's groups (as `deepspeed.initialize` builds    DeepSpeed's TP mesh (`groups._init_tp_mesh_device`)
      them; `ParallelGroups.from_deepspeed` checks them)    or Ulysses groups (`ulysses.register_ulysses_attention`)
    the step's samples (`PretrainingData.next_step`)        the global samples this data-parallel rank trains
    a streamed source's files (`streamed.rank_share`)       its files, or byte ranges / row groups of them
    the resume description (`data_description`)             what the checkpoint manifest records
    AutoTP slices (DeepSpeed's `_configure_tensor_parallel` each parameter's rows/columns (`loading._tp_pieces`),
      on the meta model; the sliced load reads them)        its vocabulary columns (`loss.vocab_shard_of`),
                                                            its attention and key-value heads
    ZeRO-3 partitions (`zero3.zero3_partition_range`)       the elements of each parameter slice it holds
    sequence slice (`ulysses.sequence_shard`)               positions [start, stop) of every row
    checkpoint files (DeepSpeed's `_configure_checkpointing` the model-states and optimizer-states files it
      and `_get_ckpt_name`, `checkpoint.rng_state_file`)    writes; `integrity.check_rank_files` checks the set
    evaluation prompts (`generate.prompt_share` over the    the prompts it generates
      dp group's `dist.get_rank`)

`check_shares` then checks that every share is complete and disjoint over the ranks that split it (samples,
files, vocabulary, heads, parameter slices and partitions, sequence positions, checkpoint files, prompts) and
that every group is what the collectives expect (the dp, sp and tp groups each partition the world, every rank
in exactly one of each, the vocabulary-parallel loss reduces over the tp group).

AutoTP (slicing an 80-layer meta model: about 2.5 s a rank on one CPU core) runs for the ranks of one
tensor-parallel group (`model_ranks`, default the group of `focus_rank`): its slices are those of every rank of
the same tp rank (DeepSpeed's AutoTP reads only the tp rank and size), which the other ranks' ZeRO partitions
and vocabulary columns use. `model_ranks="all"` runs it on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError
from ..checkpoint.format import SavedLayout, rng_state_file
from ..checkpoint.integrity import check_rank_files
from ..config import Config
from ..data import PretrainingData, data_description, resolve_files
from ..data.sources import TOKENS
from ..data.stream import _MapSource
from ..data.streamed import rank_share
from ..eval.generate import _rank_and_size, prompt_share
from ..loss import vocab_shard_of
from ..models.families import accept_scaled_embeddings, add_tp_partition_config, family_of, supports_sdpa
from ..models.loading.autotp import _tp_pieces
from ..models.loading.zero3 import zero3_partition_numel, zero3_partition_range
from ..parallel import distributed
from ..parallel.layout import ParallelGroups
from ..parallel.ulysses import register_ulysses_attention, release_ulysses_attention, sequence_shard
from .preflight import preflight

logger = logging.getLogger("ntl_pretrain")

GROUPS = ("tp", "sp", "dp", "loss")  # ParallelGroups' groups
STEPS = 2  # optimizer steps whose samples are split (the second shows the stream moves on, not restarts)
CHECKPOINT_TAG = "global_step1"
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass
class RankShare:
    """What one global rank holds and which ranks it reduces with, as its start-up computed them."""

    rank: int
    local_rank: int
    tp_rank: int
    sp_rank: int
    dp_rank: int
    groups: dict[str, tuple[int, ...]]  # tp, sp, dp, loss (ParallelGroups), vocab (the loss's), zero (DeepSpeed's)
    samples: list[tuple[int, int]]  # the steps' samples it trains: (source, index in the source)
    validation: list[int]  # the validation samples it evaluates
    stream_files: dict[str, list[tuple[int, int, int]]]  # streamed source -> (file, begin, end); end -1: whole file
    data_description: str  # the resume description (JSON), the same on every rank
    sequence: tuple[int, int]  # positions [start, stop) of every row it runs
    vocab: tuple[int, int]  # vocabulary columns [start, stop) of its LM head
    heads: dict[str, tuple[int, int]]  # attention / key_value heads [start, stop) it computes (every layer alike)
    zero_elements: int  # parameter elements it holds: its ZeRO-3 partitions (ZeRO 0-2: its tp rank's whole slices)
    checkpoint_files: list[str]  # the files it writes into a checkpoint folder
    eval_prompts: dict[str, tuple[int, int]]  # benchmark -> prompt indices [start, stop) it generates
    autotp_ran: bool = False  # AutoTP ran on this rank's own meta model (else its tp rank's slices were used)


@dataclass
class Rehearsal:
    """Every rank's shares and the facts they are checked against (`rehearse`)."""

    world_size: int
    local_world_size: int
    focus_rank: int  # the rank the summary shows
    layout: str  # ParallelLayout.describe() of rank 0
    tp_size: int
    sp_size: int
    dp_size: int
    zero_stage: int
    model: dict  # the model's sizes: layers, hidden, heads, kv heads, vocabulary, parameters
    samples_per_step: int  # micro batch x grad accumulation x dp
    stream_sources: dict[str, int]  # streamed local source -> its file count
    eval_prompt_counts: dict[str, int]
    shares: list[RankShare]
    slices: dict[int, dict[str, list[tuple[int, int, int]]]]  # tp rank -> parameter -> AutoTP pieces (dim, start, size)
    shapes: dict[str, tuple[int, ...]]  # every parameter's full shape
    zero_ranges: dict[int, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)  # rank -> param -> range
    seconds: dict[str, float] = field(default_factory=dict)  # where the rehearsal's time went
    notes: list[str] = field(default_factory=list)  # what was not rehearsed, and why
    problems: list[str] = field(default_factory=list)  # filled by check_shares

    def summary(self) -> list[str]:
        """A one-screen report."""
        focus = self.shares[self.focus_rank]
        lines = [f"rehearsal of {self.world_size} ranks ({self.local_world_size} per node): {self.layout}",
                 f"model: {self.model['layers']} layers, hidden {self.model['hidden']}, {self.model['heads']} heads / "
                 f"{self.model['kv_heads']} kv heads, vocabulary {self.model['vocab']}, "
                 f"{self.model['parameters'] / 1e9:.2f}B parameters; ZeRO-{self.zero_stage}",
                 f"rank {focus.rank}: tp {focus.tp_rank}, sp {focus.sp_rank}, dp {focus.dp_rank} (local {focus.local_rank});"
                 f" groups tp {_ranks(focus.groups['tp'])}, sp {_ranks(focus.groups['sp'])}, "
                 f"dp {_ranks(focus.groups['dp'])}, zero {_ranks(focus.groups['zero'])}",
                 f"  samples of steps 1-{STEPS}: {len(focus.samples)} of {self.samples_per_step * STEPS}; "
                 f"validation {len(focus.validation)}; vocabulary [{focus.vocab[0]}, {focus.vocab[1]}); heads "
                 + ", ".join(f"{k} [{a}, {b})" for k, (a, b) in focus.heads.items())
                 + f"; sequence [{focus.sequence[0]}, {focus.sequence[1]})",
                 f"  parameter elements held (ZeRO-{self.zero_stage}): {focus.zero_elements / 1e6:.1f}M; checkpoint files: "
                 + ", ".join(focus.checkpoint_files),
                 "  evaluation prompts: " + (", ".join(f"{k} [{a}, {b})" for k, (a, b) in focus.eval_prompts.items())
                                            or "none")]
        for key, count in self.stream_sources.items():
            lines.append(f"  {key} ({count} files): " + _files_text(focus.stream_files[key]))
        checked = ("groups (dp, sp, tp, loss, zero, vocab), samples, validation, streamed files, resume description, "
                   "vocabulary, heads, AutoTP slices, ZeRO partitions, sequence, checkpoint files, prompts")
        lines.append(f"checked over {self.world_size} ranks: {checked}")
        lines.extend(f"note: {note}" for note in self.notes)
        lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        if self.problems:
            lines.extend(f"PROBLEM: {problem}" for problem in self.problems[:20])
            if len(self.problems) > 20:
                lines.append(f"... and {len(self.problems) - 20} more problems")
        else:
            lines.append("rehearsal OK: every share complete and disjoint, every group as the collectives expect")
        return lines

    def to_json(self) -> dict:
        """The rehearsal as JSON-ready data (the slices and ZeRO ranges left out: they are large)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("slices", "zero_ranges", "shapes")}
        out["autotp_ranks"] = [share.rank for share in self.shares if share.autotp_ran]
        return out


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 4:
        step = ranks[1] - ranks[0]
        if all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} (every {step}th)"
    return ", ".join(map(str, ranks))


def _files_text(files: list[tuple[int, int, int]]) -> str:
    if not files:
        return "nothing"
    parts = [f"file {f}" if end < 0 else f"file {f} [{begin}, {end})" for f, begin, end in files[:4]]
    return ", ".join(parts) + (f", ... ({len(files)} in all)" if len(files) > 4 else "")


# ---------------------------------------------------------------------------------------------- simulated ranks

@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int, local_world_size: int) -> Iterator[None]:
    """Inside: this process is global rank `rank` of `world_size` to torch.distributed (the fake backend),
    DeepSpeed's communication and the launcher's environment variables; DeepSpeed's groups are forgotten and
    the process group destroyed on exit, so the next simulated rank starts as a fresh process would."""
    import importlib

    import deepspeed.comm as ds_comm
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    saved = {key: os.environ.get(key) for key in _RANK_ENV}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local_world_size),
                      LOCAL_WORLD_SIZE=str(local_world_size))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    ds_comm.cdb = None  # DeepSpeed wraps the process group just made (it keeps its wrapper in a module global)
    # without DeepSpeed's CPU shared-memory all-reduce op: nothing is reduced here, and loading it would build it
    # (minutes, once per environment) and map a /dev/shm buffer per simulated rank
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` is torch itself
    build_shm_op = ds_torch_backend.build_shm_op
    ds_torch_backend.build_shm_op = lambda: None
    try:
        ds_comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)
        yield
    finally:
        ds_torch_backend.build_shm_op = build_shm_op
        release_ulysses_attention()
        _forget_deepspeed_groups()
        if dist.is_initialized():
            dist.destroy_process_group()
        ds_comm.cdb = None
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _forget_deepspeed_groups() -> None:
    """DeepSpeed 0.19's group globals (`deepspeed.utils.groups`), as in a new process."""
    from deepspeed.utils import groups

    for name in ("_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_WORLD_GROUP",
                 "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                 "_MPU_TENSOR_MODEL_PARALLEL_RANK", "mpu", "mesh_device"):
        setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        getattr(groups, name).clear()


def _engine_shell(ds_config: dict, mpu: Any) -> Any:
    """A `DeepSpeedEngine` with only its configuration: what DeepSpeed's own AutoTP and checkpoint-naming methods
    read of an engine (its config, local rank), without a model, optimizer or memory."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    shell = DeepSpeedEngine.__new__(DeepSpeedEngine)
    torch.nn.Module.__init__(shell)
    shell._config = DeepSpeedConfig(copy.deepcopy(ds_config), mpu=mpu)
    shell.local_rank = int(os.environ["LOCAL_RANK"])
    shell.has_moe_layers = False
    return shell


@contextlib.contextmanager
def _autotp_training_mode() -> Iterator[None]:
    """AutoTP in its training mode, as deepspeed.initialize sets it for a config with tensor_parallel.autotp_size
    (the heuristic AutoTP of a model without a tp_plan, Falcon's, reads inference settings otherwise)."""
    from deepspeed.module_inject import layers

    before = layers.get_auto_tp_mode()
    layers.set_autotp_mode(training=True)
    try:
        yield
    finally:
        layers.DEEPSPEED_AUTOTP_MODE = before


def _meta_model(model_config: Any) -> torch.nn.Module:
    """The run's model on the meta device (shapes only; sdpa attention, which Ulysses wraps, where the model has
    one: Gemma2's eager)."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    with torch.device("meta"), no_init_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(model_config), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa" if supports_sdpa(model_config) else "eager")
    model.tie_weights()  # a tied head is the embedding, as the trainer's builds and loads leave it
    return model


# ------------------------------------------------------------------------------------------------- the rehearsal

def rehearse(cfg: Config, world_size: int, local_world_size: int = 8, focus_rank: int | None = None,
             model_ranks: str | list[int] = "focus") -> Rehearsal:
    """Run the start-up of every rank of a `world_size`-rank run of `cfg` (its model.name_or_path a local folder
    with config.json) in this process, and check the shares (`check_shares`; problems in `.problems`).

    `focus_rank` (default: 173, or the last rank of a smaller world) is the rank the summary shows and whose
    tensor-parallel group runs AutoTP (`model_ranks="focus"`; "all": every rank; or a list of ranks)."""
    from deepspeed.utils import groups as ds_groups

    started, cpu_started = time.perf_counter(), time.process_time()
    seconds: dict[str, float] = {}  # wall seconds by phase, and the CPU seconds of the whole
    if dist.is_initialized():
        raise RuntimeError("the rehearsal simulates ranks with its own process groups: run it in a process "
                           "without torch.distributed initialised")
    checked = preflight(cfg, world_size, on_cpu=False, local_world_size=local_world_size, local_files_only=True)
    if checked.model_config is None:
        raise ValueError(f"model.name_or_path={cfg.model.name_or_path!r} has no config.json here: give a local "
                         f"folder with the model's config.json (tools/rehearse.py --model-config PATH)")
    cfg, ds_config, model_config = checked.run.cfg, checked.run.ds_config, checked.model_config
    tp, sp = cfg.parallel.tp_size, cfg.parallel.sp_size
    if tp > 1:  # AutoTP gets the family's own layer specs and takes Gemma2's embedding, as build_model sets them
        ds_config = copy.deepcopy(ds_config)
        add_tp_partition_config(ds_config, family_of(model_config)[0])
        accept_scaled_embeddings()
    dp = world_size // (tp * sp)
    focus = min(173, world_size - 1) if focus_rank is None else focus_rank
    if not 0 <= focus < world_size:
        raise ValueError(f"focus rank {focus} is outside the world of {world_size} ranks: give one of 0-{world_size - 1}")
    seconds["config checks"] = time.perf_counter() - started

    phase = time.perf_counter()
    reference = _meta_model(model_config)
    text = model_config.get_text_config()
    shapes = {name: tuple(param.shape) for name, param in reference.named_parameters()}
    model_facts = {"layers": text.num_hidden_layers, "hidden": text.hidden_size, "heads": text.num_attention_heads,
                   "kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                   "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                   "vocab": reference.get_output_embeddings().weight.shape[0],
                   "parameters": sum(param.numel() for param in reference.parameters())}
    seconds["meta model"] = time.perf_counter() - phase

    if model_ranks == "all":
        autotp_ranks = set(range(world_size))
    elif model_ranks == "focus":
        autotp_ranks = {focus - focus % tp + t for t in range(tp)}
    else:
        autotp_ranks = set(model_ranks)
    autotp_ranks = autotp_ranks if tp > 1 else set()

    data = _IndexedData(cfg, dp)
    streams = _local_streams(cfg)
    eval_counts = _eval_prompt_counts(cfg)
    notes = list(data.notes) + [f"{key}: a hub stream; its shards are split by `datasets` at start-up (rank r "
                                f"reads shards r, r + dp, ...), not rehearsed here"
                                for key in _hub_streams(cfg)]
    notes.append("the vocabulary is config.json's; a tokenizer that grows it (model.resize_embeddings) pads it to a "
                 "multiple of lcm(model.pad_vocab_to_multiple_of, tp_size) at start-up")
    notes.append("the Hugging Face export at the end is written by global rank 0 alone (run_on_main)")
    notes += [f"the prompts of benchmark {benchmark.name!r} are not rehearsed (no count in PROMPT_COUNTS)"
              for benchmark in _enabled_benchmarks(cfg) if benchmark.name not in PROMPT_COUNTS]

    shares: list[RankShare] = []
    slices: dict[int, dict[str, list[tuple[int, int, int]]]] = {}
    vocab_of: dict[int, tuple[int, int]] = {}
    layout0 = ""
    timing = {"ranks": 0.0, "autotp": 0.0}
    pending_zero: list[tuple[RankShare, int, int]] = []  # (share, zero rank, zero size): partitions once slices are known
    for rank in range(world_size):
        phase = time.perf_counter()
        with simulated_rank(rank, world_size, local_world_size):
            layout = distributed.layout(cfg.parallel)
            mpu = None
            if tp > 1:  # what deepspeed.initialize does for AutoTP (DeepSpeedEngine._configure_tensor_parallel_states)
                ds_groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
                mpu = ds_groups
            elif sp > 1:  # the trainer registers Ulysses before deepspeed.initialize (engine.build_engine)
                ulysses = register_ulysses_attention(reference, sp, cfg.data.micro_batch_size,
                                                     document_mask=cfg.data.document_mask)
                mpu = ulysses.mpu
            ds_groups.mpu = mpu  # as DeepSpeedEngine.__init__ hands its mpu to its groups
            parallel_groups = ParallelGroups.from_deepspeed(layout)  # raises when a group differs from the layout
            zero_group = ds_groups._get_sequence_data_parallel_group()  # ZeRO's partition group (the engine's)
            group_ranks = {name: _group_ranks(getattr(parallel_groups, f"{name}_group"), rank) for name in GROUPS}
            group_ranks["vocab"] = _group_ranks(parallel_groups.vocab_group, rank)
            group_ranks["zero"] = _group_ranks(zero_group, rank)
            shell = _engine_shell(ds_config, mpu)
            shell.checkpoint_mp_rank = mpu.get_model_parallel_rank() if tp > 1 else 0  # DeepSpeedEngine.__init__
            if layout.rank in autotp_ranks:
                autotp_started = time.perf_counter()
                model = copy.deepcopy(reference)  # a fresh meta model (AutoTP replaces its layers in place)
                with _autotp_training_mode():
                    shell._configure_tensor_parallel(model, shell.tensor_parallel_config())
                tp_rank = ds_groups.get_tensor_model_parallel_rank()
                mine = {name: _tp_pieces(param, name, tp_rank) or [] for name, param in model.named_parameters()}
                if set(mine) != set(shapes):  # every parameter is checked by its name in the unsliced model
                    raise RuntimeError(f"AutoTP changed the model's parameters: {sorted(set(mine) ^ set(shapes))[:4]}")
                if tp_rank in slices and slices[tp_rank] != mine:
                    raise RuntimeError(f"AutoTP gave rank {rank} other slices than another rank of tp rank {tp_rank}")
                slices[tp_rank] = mine
                shard = vocab_shard_of(model)
                vocab_of[tp_rank] = (shard.start, shard.start + (shard.width or model_facts["vocab"]))
                if _group_ranks(shard.tp_group, rank) != group_ranks["tp"]:
                    raise RuntimeError(f"rank {rank}: the LM head's vocabulary group {_group_ranks(shard.tp_group, rank)}"
                                       f" is not the tp group {group_ranks['tp']}")
                del model
                timing["autotp"] += time.perf_counter() - autotp_started
            elif tp == 1:
                shard = vocab_shard_of(reference)
                vocab_of[0] = (shard.start, shard.start + (shard.width or model_facts["vocab"]))
            share = RankShare(
                rank=rank, local_rank=layout.local_rank, tp_rank=layout.tp_rank, sp_rank=layout.sp_rank,
                dp_rank=layout.dp_rank, groups=group_ranks,
                samples=data.step_samples(layout.data_rank, layout.data_size),
                validation=data.validation_samples(layout.data_rank, layout.data_size),
                stream_files={key: _stream_share(builder, files, layout.data_rank, layout.data_size, key)
                              for key, (builder, files) in streams.items()},
                data_description=json.dumps(data_description(cfg.data), sort_keys=True, default=str),
                sequence=(sequence_shard(mpu if sp > 1 else None).bounds(cfg.data.seq_len)),
                vocab=(0, 0), heads=_ulysses_heads(ulysses.implementation, layout.sp_rank) if sp > 1 else {},
                zero_elements=0,
                checkpoint_files=_checkpoint_files(shell, zero_group, layout.rank),
                eval_prompts=_eval_prompts(eval_counts, parallel_groups.dp_group),
                autotp_ran=layout.rank in autotp_ranks)
            if layout.is_main:
                layout0 = layout.describe()
            pending_zero.append((share, dist.get_rank(zero_group), dist.get_world_size(zero_group)))
            shares.append(share)
        timing["ranks"] += time.perf_counter() - phase
    seconds["ranks"] = timing["ranks"] - timing["autotp"]
    seconds[f"AutoTP on {len(autotp_ranks)} ranks"] = timing["autotp"]

    phase = time.perf_counter()
    if tp == 1:
        slices[0] = {name: [] for name in shapes}
    missing = sorted({share.tp_rank for share in shares} - set(slices))
    if missing:
        raise ValueError(f"model_ranks={model_ranks!r} ran AutoTP on no rank of tp rank(s) {missing}: include one "
                         f"rank of each tp rank (the default runs the focus rank's tp group)")
    zero_ranges: dict[int, dict[str, list[tuple[int, int]]]] = {}
    slice_numels = {t: {name: _slice_numel(shape, pieces[name]) for name, shape in shapes.items()}
                    for t, pieces in slices.items()}
    for share, zero_rank, zero_size in pending_zero:
        pieces = slices[share.tp_rank]
        share.vocab = vocab_of[share.tp_rank]
        share.heads = share.heads or _heads(pieces, shapes, model_facts)
        if cfg.parallel.zero_stage != 3:  # ZeRO 0-2: every rank holds its tp rank's slices whole
            share.zero_elements = sum(slice_numels[share.tp_rank].values())
            continue
        ranges = {}
        for name, numel in slice_numels[share.tp_rank].items():
            ranges[name] = [zero3_partition_range(numel, zero3_partition_numel(numel, zero_size), zero_rank)]
        share.zero_elements = sum(max(0, stop - start) for [(start, stop)] in ranges.values())
        zero_ranges[share.rank] = ranges
    seconds["partitions"] = time.perf_counter() - phase
    rehearsal = Rehearsal(
        world_size=world_size, local_world_size=local_world_size, focus_rank=focus, layout=layout0, tp_size=tp,
        sp_size=sp, dp_size=dp,
        zero_stage=cfg.parallel.zero_stage, model=model_facts,
        samples_per_step=cfg.data.micro_batch_size * cfg.train.grad_accum_steps * dp,
        stream_sources={key: len(files) for key, (_, files) in streams.items()}, eval_prompt_counts=eval_counts,
        shares=shares, slices=slices, shapes=shapes, zero_ranges=zero_ranges, seconds=seconds, notes=notes)
    phase = time.perf_counter()
    rehearsal.problems = check_shares(rehearsal)
    seconds["checks"] = time.perf_counter() - phase
    seconds["total"] = time.perf_counter() - started
    seconds["total CPU"] = time.process_time() - cpu_started
    return rehearsal


def _group_ranks(group: Any, rank: int) -> tuple[int, ...]:
    """The global ranks of `group` (None: the rank alone, as `ParallelGroups` means it)."""
    return (rank,) if group is None else tuple(sorted(dist.get_process_group_ranks(group)))


def _slice_numel(shape: tuple[int, ...], pieces: list[tuple[int, int, int]]) -> int:
    """The elements of the slice `pieces` (AutoTP's (dim, start, size); none: whole) of a parameter of `shape`."""
    numel = 1
    for size in shape:
        numel *= size
    if not pieces:
        return numel
    dim = pieces[0][0]
    return numel // shape[dim] * sum(size for _, _, size in pieces)


def _heads(pieces: dict[str, list[tuple[int, int, int]]], shapes: dict[str, tuple[int, ...]],
           model: dict) -> dict[str, tuple[int, int]]:
    """The attention and key-value heads [start, stop) a rank computes, from its rows of the first layer's q and k
    projections (AutoTP splits them by whole heads; every layer's slices are checked to tile by `check_shares`)."""
    out = {}
    for kind, suffix in (("attention", "self_attn.q_proj.weight"), ("key_value", "self_attn.k_proj.weight")):
        name = next((n for n in shapes if n.endswith(suffix)), None)
        if name is None:
            continue
        rows = pieces[name]
        start, size = (rows[0][1], rows[0][2]) if rows else (0, shapes[name][0])
        out[kind] = (start // model["head_dim"], (start + size) // model["head_dim"])
    return out


def _ulysses_heads(implementation: str, sp_rank: int) -> dict[str, tuple[int, int]]:
    """The attention and key-value heads [start, stop) sequence-parallel rank `sp_rank` computes after Ulysses'
    all-to-all: DeepSpeed's `UlyssesSPAttentionHF` (found in the attention table it wrapped) gives each rank
    `local_q_head_count` consecutive heads in rank order, and its kv heads, one replicated kv head per
    `kv_replication_factor` ranks when sp exceeds them."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    wrapper = ALL_ATTENTION_FUNCTIONS[implementation]
    found = [cell.cell_contents for cell in wrapper.__closure__ or ()
             if isinstance(cell.cell_contents, UlyssesSPAttentionHF)]
    if len(found) != 1:
        raise RuntimeError(f"the {implementation!r} attention is not DeepSpeed's Ulysses wrapper after "
                           f"register_ulysses_attention")
    attention = found[0]
    q, kv = attention.local_q_head_count, attention.local_kv_head_count
    if attention.global_kv_head_count < attention.world_size:
        first_kv = sp_rank // attention.kv_replication_factor
        return {"attention": (sp_rank * q, (sp_rank + 1) * q), "key_value": (first_kv, first_kv + 1)}
    return {"attention": (sp_rank * q, (sp_rank + 1) * q), "key_value": (sp_rank * kv, (sp_rank + 1) * kv)}


def _checkpoint_files(shell: Any, zero_group: Any, rank: int) -> list[str]:
    """The files this rank writes into a checkpoint folder: DeepSpeed's decision and names
    (`DeepSpeedEngine._configure_checkpointing`, `_get_ckpt_name`, `_get_zero_ckpt_name`, run on an engine with
    this rank's groups), and the manager's RNG-state file."""
    from types import SimpleNamespace

    shell.optimizer = SimpleNamespace(dp_process_group=zero_group)  # ZeRO's partition group, as its optimizer holds
    shell.save_non_zero_checkpoint = shell.save_zero_checkpoint = False  # DeepSpeedEngine.__init__'s defaults
    shell._configure_checkpointing()
    files = [rng_state_file(rank)]
    if shell.save_non_zero_checkpoint:
        files.append(os.path.basename(shell._get_ckpt_name("", CHECKPOINT_TAG)))
    if shell.save_zero_checkpoint:
        files.append(os.path.basename(shell._get_zero_ckpt_name("", CHECKPOINT_TAG)))
    return files


def _enabled_benchmarks(cfg: Config) -> list[Any]:
    """The benchmarks the run's evaluation runs (none when it runs no evaluation)."""
    from ..eval.benchmarks import BENCHMARKS

    if not (cfg.eval.at_end or cfg.eval.every_n_steps > 0):
        return []
    return [benchmark for benchmark in BENCHMARKS if benchmark.enabled(cfg.eval)]


def _eval_prompt_counts(cfg: Config) -> dict[str, int]:
    """The periodic evaluation's prompt count of each benchmark the config runs (`PROMPT_COUNTS`)."""
    return {benchmark.name: PROMPT_COUNTS[benchmark.name](cfg.eval) for benchmark in _enabled_benchmarks(cfg)
            if benchmark.name in PROMPT_COUNTS}


# how many prompts each benchmark's periodic evaluation generates, from the `eval` settings (a benchmark missing
# here is named in the rehearsal's notes and not rehearsed)
PROMPT_COUNTS = {
    "arith": lambda settings: settings.arithmetic_n * len(settings.arithmetic_splits),  # n per split
    "gsm8k": lambda settings: settings.gsm8k_limit or 1319,  # 0: the 1,319 test problems
}


def _eval_prompts(counts: dict[str, int], dp_group: Any) -> dict[str, tuple[int, int]]:
    """This rank's prompts of each benchmark, split as `greedy_generate` splits them (over the dp group)."""
    dp_rank, dp_size = _rank_and_size(dp_group)
    out = {}
    for name, count in counts.items():
        share = prompt_share(count, dp_rank, dp_size)
        out[name] = (share.start, max(share.start, share.stop))
    return out


def _local_streams(cfg: Config) -> dict[str, tuple[str, list[str]]]:
    """The streamed sources with local files: key -> (builder, files)."""
    out = {}
    for index, source in enumerate(cfg.data.sources):
        key = f"data.sources.{index}"
        if source.streaming:
            resolved = resolve_files(source, key)
            if resolved is not None:
                out[key] = resolved
    return out


def _hub_streams(cfg: Config) -> list[str]:
    out = []
    for index, source in enumerate(cfg.data.sources):
        key = f"data.sources.{index}"
        if source.streaming and resolve_files(source, key) is None:
            out.append(key)
    return out


def _stream_share(builder: str, files: list[str], dp_rank: int, dp_size: int, key: str) -> list[tuple[int, int, int]]:
    """A streamed source's share of one data-parallel rank as (file, begin, end), end -1 for a whole file."""
    share = rank_share(builder, files, dp_rank, dp_size, key, say=False)
    if share.ranges is not None:
        return [(index, begin, end) for index, (begin, end) in share.ranges.items()]
    return [(index, 0, -1) for index in share.files]


class _NumberedSamples:
    """Samples that say which they are: sample k of source i is the tokens [i, k, 0] (a stand-in for a packed
    source's samples, of any size, without storage)."""

    def __init__(self, source: int, size: int) -> None:
        self.source, self.size = source, size

    def with_format(self, _format: str) -> "_NumberedSamples":
        return self

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> dict:
        return {TOKENS: np.asarray([self.source, k, 0])}


class _IndexedData:
    """The run's sample stream with every source replaced by numbered samples: `PretrainingData` itself (its seeded
    mixture, stages, per-epoch permutations and micro-batch split) decides which samples each data-parallel rank
    trains; a sample's tokens say which it is (source, index)."""

    SOURCE_SAMPLES = 1_000_000  # per source: more than the rehearsed steps take, so no sample repeats

    def __init__(self, cfg: Config, dp_size: int) -> None:
        self.cfg = cfg
        val_batches = max(cfg.train.val_batches, 1)
        self.validation = [(np.asarray([-1, k, 0]), None)
                           for k in range(cfg.data.micro_batch_size * dp_size * val_batches + 1)]
        self.notes = [f"the data: each source stands in as {self.SOURCE_SAMPLES} numbered samples (the mixture, "
                      f"stages and split are the run's own; the samples' contents are not read)"]

    def _data(self, dp_rank: int, dp_size: int) -> PretrainingData:
        sources = [_MapSource(_NumberedSamples(index, self.SOURCE_SAMPLES), self.cfg.data.seed, index)
                   for index in range(len(self.cfg.data.sources))]
        return PretrainingData(self.cfg.data, sources, self.validation, dp_rank=dp_rank, dp_size=dp_size, eos_id=-2)

    def step_samples(self, dp_rank: int, dp_size: int) -> list[tuple[int, int]]:
        """The samples data-parallel rank `dp_rank` trains in the first STEPS steps: (source, index)."""
        data = self._data(dp_rank, dp_size)
        out = []
        for _ in range(STEPS):
            for batch in data.next_step(self.cfg.train.grad_accum_steps):
                out.extend((int(row[0]), int(row[1])) for row in batch.input_ids.tolist())
        return out

    def validation_samples(self, dp_rank: int, dp_size: int) -> list[int]:
        """The validation samples data-parallel rank `dp_rank` evaluates."""
        data = self._data(dp_rank, dp_size)
        return [int(row[1]) for batch in data.validation_micro_batches(self.cfg.train.val_batches)
                for row in batch.input_ids.tolist()]


# ------------------------------------------------------------------------------------------------------ the checks

def check_shares(rehearsal: Rehearsal) -> list[str]:
    """Every problem of a rehearsal's shares, one line each (none: every share is complete and disjoint over the
    ranks that split it, every group as the collectives expect)."""
    problems: list[str] = []
    shares = rehearsal.shares
    world = rehearsal.world_size
    ranks = [share.rank for share in shares]
    if ranks != list(range(world)):
        problems.append(f"the rehearsal holds ranks {ranks[:5]}..., not 0..{world - 1}")
        return problems
    problems += _check_groups(rehearsal)
    problems += _check_nodes(rehearsal)
    problems += _check_data(rehearsal)
    problems += _check_model(rehearsal)
    problems += _check_sequence(rehearsal)
    problems += _check_checkpoint(rehearsal)
    problems += _check_prompts(rehearsal)
    return problems


def _check_nodes(rehearsal: Rehearsal) -> list[str]:
    """Each tensor-parallel group within one node (nodes: consecutive blocks of local_world_size ranks, as the
    launchers number them): AutoTP all-reduces several times a layer, which across nodes go over the network."""
    lws = rehearsal.local_world_size
    spanning = sorted({share.groups["tp"] for share in rehearsal.shares
                       if len({rank // lws for rank in share.groups["tp"]}) > 1})
    if not spanning:
        return []
    heads = (rehearsal.model["heads"], rehearsal.model["kv_heads"])
    fits = [t for t in range(1, lws + 1) if lws % t == 0 and rehearsal.world_size % t == 0
            and all(h % t == 0 for h in heads)]
    return [f"{len(spanning)} tp group(s) span two nodes of {lws} processes (first: ranks {_ranks(spanning[0])}): "
            f"AutoTP's per-layer all-reduces would cross the network; set parallel.tp_size to one of {fits} "
            f"(dividing the processes per node)"]


def _partition_problems(what: str, members: dict[int, tuple[int, ...]], world: int) -> list[str]:
    """The groups named `what` (rank -> its group's ranks) partition the world: every rank in its own group,
    every two ranks' groups equal or disjoint, together every rank once."""
    problems = []
    distinct: dict[tuple[int, ...], None] = {}
    for rank, group in members.items():
        if rank not in group:
            problems.append(f"rank {rank} is not in its own {what} group {list(group)}")
        distinct.setdefault(group, None)
    seen: dict[int, tuple[int, ...]] = {}
    for group in distinct:
        for rank in group:
            if rank in seen:
                problems.append(f"rank {rank} is in two {what} groups: {list(seen[rank])} and {list(group)}")
            seen[rank] = group
    if sorted(seen) != list(range(world)):
        problems.append(f"the {what} groups cover {len(seen)} of {world} ranks")
    for rank, group in members.items():
        if seen.get(rank) is not None and any(members.get(peer) != group for peer in group):
            problems.append(f"rank {rank}'s {what} group {list(group)} is not the group its members name")
            break
    return problems


def _check_groups(rehearsal: Rehearsal) -> list[str]:
    shares, world = rehearsal.shares, rehearsal.world_size
    problems = []
    sizes = {"tp": rehearsal.tp_size, "sp": rehearsal.sp_size, "dp": rehearsal.dp_size,
             "loss": rehearsal.dp_size * rehearsal.sp_size, "zero": rehearsal.dp_size * rehearsal.sp_size,
             "vocab": rehearsal.tp_size}
    for name, size in sizes.items():
        members = {share.rank: share.groups[name] for share in shares}
        problems += _partition_problems(name, members, world)
        wrong = [share.rank for share in shares if len(share.groups[name]) != size]
        if wrong:
            problems.append(f"{len(wrong)} ranks' {name} groups do not hold {size} ranks (rank {wrong[0]}: "
                            f"{list(shares[wrong[0]].groups[name])})")
    for share in shares:
        if share.groups["vocab"] != share.groups["tp"]:
            problems.append(f"rank {share.rank}: the vocabulary-parallel loss reduces over {list(share.groups['vocab'])}"
                            f", not its tp group {list(share.groups['tp'])}")
        if share.groups["zero"] != share.groups["loss"]:
            problems.append(f"rank {share.rank}: ZeRO partitions over {list(share.groups['zero'])}, the losses are "
                            f"summed over {list(share.groups['loss'])} (the dp x sp ranks)")
        for name, rank_of in (("tp", "tp_rank"), ("sp", "sp_rank"), ("dp", "dp_rank")):
            group = share.groups[name]
            if share.rank in group and group.index(share.rank) != getattr(share, rank_of):
                problems.append(f"rank {share.rank} is member {group.index(share.rank)} of its {name} group but has "
                                f"{rank_of} {getattr(share, rank_of)}")
        if share.local_rank != share.rank % rehearsal.local_world_size:
            problems.append(f"rank {share.rank} has local rank {share.local_rank}")
    return problems


def _peers_agree(rehearsal: Rehearsal, what: str, value_of: Any, group: str) -> list[str]:
    """`value_of(share)` is the same on every rank of each `group` (tp and sp peers train the same samples)."""
    for share in rehearsal.shares:
        for peer in share.groups[group]:
            if value_of(rehearsal.shares[peer]) != value_of(share):
                return [f"ranks {share.rank} and {peer} ({group} peers) hold different {what}"]
    return []


def _check_data(rehearsal: Rehearsal) -> list[str]:
    problems = []
    by_dp = {}
    for share in rehearsal.shares:
        by_dp.setdefault(share.dp_rank, share)
    for group in ("tp", "sp"):
        problems += _peers_agree(rehearsal, "samples", lambda s: s.samples, group)
        problems += _peers_agree(rehearsal, "validation samples", lambda s: s.validation, group)
        problems += _peers_agree(rehearsal, "streamed files", lambda s: s.stream_files, group)
    total = rehearsal.samples_per_step * STEPS
    taken = [sample for share in by_dp.values() for sample in share.samples]
    if len(taken) != total or len(set(taken)) != total:
        problems.append(f"the data-parallel ranks train {len(taken)} samples ({len(set(taken))} different) of "
                        f"steps 1-{STEPS}, not the {total} of the global batches once each")
    counts = {len(share.samples) for share in by_dp.values()}
    if len(counts) > 1:
        problems.append(f"data-parallel ranks train different sample counts {sorted(counts)}")
    validation = [k for share in by_dp.values() for k in share.validation]
    if len(validation) != len(set(validation)):
        problems.append("a validation sample is evaluated by two data-parallel ranks")
    if len({len(share.validation) for share in by_dp.values()}) > 1:
        problems.append("data-parallel ranks evaluate different validation counts (their collectives would not match)")
    for key, file_count in rehearsal.stream_sources.items():
        problems += _stream_problems(key, file_count, [share.stream_files[key] for share in by_dp.values()])
    descriptions = {share.data_description for share in rehearsal.shares}
    if len(descriptions) != 1:
        problems.append(f"the ranks record {len(descriptions)} different resume descriptions of the data")
    return problems


def _stream_problems(key: str, file_count: int, parts: list[list[tuple[int, int, int]]]) -> list[str]:
    """A streamed source's shares: whole files once each over the ranks, or byte ranges tiling each file."""
    whole = [f for part in parts for f, _, end in part if end < 0]
    ranged = [(f, begin, end) for part in parts for f, begin, end in part if end >= 0]
    if whole and ranged:
        return [f"{key}: some ranks read whole files, others ranges"]
    if whole:
        every = len(parts) > 1 and all(sorted(f for f, _, _ in part) == list(range(file_count)) for part in parts)
        if every:
            return []  # fewer files than ranks and not splittable: every rank reads all (said at start-up)
        if sorted(whole) != list(range(file_count)):
            return [f"{key}: the ranks read files {sorted(whole)[:8]}..., not each of its {file_count} files once"]
        return []
    by_file: dict[int, list[tuple[int, int]]] = {}
    for f, begin, end in ranged:
        by_file.setdefault(f, []).append((begin, end))
    problems = []
    if sorted(by_file) != list(range(file_count)):
        problems.append(f"{key}: the ranks' ranges cover files {sorted(by_file)}, not all {file_count}")
    for f, pieces in by_file.items():
        pieces.sort()
        if pieces[0][0] != 0 or any(a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
            problems.append(f"{key}: the ranks' ranges of file {f} {pieces[:4]} leave a gap or overlap")
    return problems


def _tiles(pieces: list[tuple[int, int]], total: int) -> bool:
    """Whether the [start, stop) pieces (non-empty ones) cover [0, total) once, with no gap or overlap."""
    end = 0
    for start, stop in sorted(p for p in pieces if p[1] > p[0]):
        if start != end:
            return False
        end = stop
    return end == total


def _check_model(rehearsal: Rehearsal) -> list[str]:
    problems = []
    shares, model, tp = rehearsal.shares, rehearsal.model, rehearsal.tp_size
    for share in shares:
        tp_group = share.groups["tp"]
        if share.rank == tp_group[0] and not _tiles([shares[r].vocab for r in tp_group], model["vocab"]):
            problems.append(f"the vocabulary columns of tp group {_ranks(tp_group)} "
                            f"{[shares[r].vocab for r in tp_group]} do not tile [0, {model['vocab']})")
            break
    head_group = "sp" if rehearsal.sp_size > 1 else "tp"  # the heads are split by AutoTP or by Ulysses
    replicated_kv = model["kv_heads"] < rehearsal.sp_size  # Ulysses: one kv head on each sp / kv ranks
    for share in shares:
        group = share.groups[head_group]
        if share.rank != group[0]:
            continue
        for kind, total in (("attention", model["heads"]), ("key_value", model["kv_heads"])):
            pieces = [shares[r].heads[kind] for r in group if kind in shares[r].heads]
            if not pieces:  # fused attention projections (Phi-3's qkv_proj, GPT-NeoX's query_key_value): not read
                continue
            if head_group == "tp" and all(piece == (0, total) for piece in pieces):
                continue  # attention AutoTP leaves whole (the family's layer specs: Phi-3, OLMo2): every rank all heads
            if kind == "key_value" and replicated_kv:
                covered = sorted(head for start, stop in pieces for head in range(start, stop))
                tiled = covered == sorted(list(range(total)) * (len(group) // total))
            else:
                tiled = _tiles(pieces, total)
            if not tiled:
                problems.append(f"the {kind} heads of {head_group} group {_ranks(group)} {pieces} do not tile the "
                                f"model's {total}")
    problems += _peers_agree(rehearsal, "vocabulary columns", lambda s: s.vocab, "dp")
    problems += _peers_agree(rehearsal, "heads", lambda s: s.heads, "dp")
    # each parameter: the tp ranks' slices tile it along their dim (or it is replicated on every tp rank)
    for name, shape in rehearsal.shapes.items():
        pieces = [rehearsal.slices[t][name] for t in range(tp)]
        if all(not p for p in pieces):
            continue
        if any(not p for p in pieces):
            problems.append(f"{name}: sliced on some tp ranks, whole on others")
            continue
        dims = {dim for p in pieces for dim, _, _ in p}
        if len(dims) != 1:
            problems.append(f"{name}: sliced along several dims {sorted(dims)}")
            continue
        dim = dims.pop()
        if not _tiles([(start, start + size) for p in pieces for _, start, size in p], shape[dim]):
            problems.append(f"{name}: the tp ranks' slices {pieces} do not tile its {shape[dim]} along dim {dim}")
    if not rehearsal.zero_ranges:  # ZeRO 0-2: the weights are not partitioned
        return problems
    # each parameter slice: the ZeRO partitions of its zero group tile it
    seen_groups: set[tuple[int, ...]] = set()
    for share in shares:
        group = share.groups["zero"]
        if group in seen_groups:
            continue
        seen_groups.add(group)
        for name, shape in rehearsal.shapes.items():
            numel = _slice_numel(shape, rehearsal.slices[share.tp_rank][name])
            ranges = [rehearsal.zero_ranges[r][name][0] for r in group]
            if not _tiles(ranges, numel):
                problems.append(f"{name}: the ZeRO-3 partitions of ranks {_ranks(group)} {ranges[:4]}... do not tile "
                                f"its {numel} elements (tp rank {share.tp_rank})")
                break
    # one zero group per tp rank: together they hold each tp rank's slices once (replicated parameters once per tp rank)
    held = sum(share.zero_elements for share in shares)
    slices = sum(_slice_numel(shape, rehearsal.slices[t][name]) for t in range(tp)
                 for name, shape in rehearsal.shapes.items())
    if held != slices:
        problems.append(f"the ranks' ZeRO-3 partitions hold {held} elements, the tp ranks' slices {slices}")
    return problems


def _check_sequence(rehearsal: Rehearsal) -> list[str]:
    problems = []
    seq_len = None
    for share in rehearsal.shares:
        group = share.groups["sp"]
        if share.rank != group[0]:
            continue
        pieces = [rehearsal.shares[r].sequence for r in group]
        seq_len = max(stop for _, stop in pieces)
        if not _tiles(pieces, seq_len):
            problems.append(f"the sequence slices of sp group {_ranks(group)} {pieces} do not tile its rows")
    lengths = {max(rehearsal.shares[r].sequence[1] for r in s.groups["sp"]) for s in rehearsal.shares}
    if len(lengths) > 1:
        problems.append(f"sp groups run rows of different lengths {sorted(lengths)}")
    return problems


def _check_checkpoint(rehearsal: Rehearsal) -> list[str]:
    """Each file written by exactly one rank, and the folder's set the one `integrity.check_rank_files` accepts
    for this layout (its check at every resume and export)."""
    writers: dict[str, int] = {}
    problems = []
    for share in rehearsal.shares:
        for name in share.checkpoint_files:
            if name in writers:
                problems.append(f"checkpoint file {name} is written by ranks {writers[name]} and {share.rank}")
            writers[name] = share.rank
    layout = SavedLayout(world_size=rehearsal.world_size, dp_size=rehearsal.dp_size, tp_size=rehearsal.tp_size,
                         zero_stage=rehearsal.zero_stage, sp_size=rehearsal.sp_size)
    manifest = {"layout": asdict(layout), "files": {name: 0 for name in writers}}
    try:
        check_rank_files(CHECKPOINT_TAG, manifest)
    except CheckpointError as error:
        problems.append(str(error))
    return problems


def _check_prompts(rehearsal: Rehearsal) -> list[str]:
    problems = []
    for name, count in rehearsal.eval_prompt_counts.items():
        for group in ("tp", "sp"):
            problems += _peers_agree(rehearsal, f"{name} prompts", lambda s, name=name: s.eval_prompts[name], group)
        firsts = {}
        for share in rehearsal.shares:
            firsts.setdefault(share.groups["dp"], [rehearsal.shares[r].eval_prompts[name] for r in share.groups["dp"]])
        for group, pieces in firsts.items():
            if not _tiles(pieces, count):
                problems.append(f"the {name} prompts of dp group {_ranks(group)} {pieces[:4]}... do not tile its "
                                f"{count} prompts")
                break
    return problems
