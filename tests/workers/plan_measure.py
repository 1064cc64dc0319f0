"""Worker: what a real training step holds, saves for backward, sends and writes, per rank, measured on the real
Trainer (DeepSpeed ZeRO-3 engine), for tests/test_plan_measured.py to hold the planner (`ntl_pretrain.plan`) to.

For each case (CONFIG.yaml + its overrides; the cases of one launch share its process group): one warm-up step
(ZeRO-3 records its parameter trace), then one measured step, then a checkpoint save. Each rank writes
`OUT/<case>/rank<r>.json` with:

- `model_states`: every parameter's full (after AutoTP) and partitioned numel (`ds_numel`, `ds_tensor.numel()`),
  the optimizer's fp32 partitions (and whether they share the parameters' storage), Adam's moments, the
  gradient partition buffer: DeepSpeed's own tensors, read from the engine;
- `saved`: the bytes one micro-batch's forward saved for backward in the measured step (the largest; torch's
  saved-tensor hooks; each storage counted once; model parameters left out: they are ZeRO-3's gathered weights,
  not activations), split into the decoder layers and the rest (embedding, final norm, head and loss);
- `gathered_peak`: the most bytes of (non-persistent) ZeRO-3 parameters gathered at once during the step;
- `logits`: the shape and dtype of each output of the LM head module in the measured step;
- `collectives`: every torch.distributed collective of the measured step: its name, the ranks of its group, bytes;
- `checkpoint`: the files of the saved checkpoint with their sizes and the bytes of the tensors each holds.

    plan_measure.py OUT CONFIG.yaml CASES.json   (once per rank; tests/helpers/distributed.py)
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce_scatter",
               "all_to_all_single", "broadcast", "_all_gather_base", "_reduce_scatter_base", "all_to_all")
# where a collective's full tensor is (an all-gather's output, a reduce-scatter's or all-to-all's input): the
# position and keyword names of the argument; others: the tensor given, first
FULL_TENSOR = {"all_gather_into_tensor": (0, ("output_tensor",)), "_all_gather_base": (0, ("output_tensor",)),
               "reduce_scatter_tensor": (1, ("input",)), "_reduce_scatter_base": (1, ("input",)),
               "all_gather": (0, ("tensor_list",)), "all_to_all_single": (1, ("input",)),
               "all_to_all": (1, ("input_tensor_list",))}
RECORDED: list[dict] | None = None  # the collectives of the measured step (None: not recording)


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _counting(name: str, original):
    """`original` (a torch.distributed collective), recording its call while `RECORDED` is a list: the bytes of the
    full tensor (all-gather: its output; reduce-scatter: its input; others: the tensor given)."""
    def call(*args, **kwargs):
        if RECORDED is not None:
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
            position, keys = FULL_TENSOR.get(name, (0, ("tensor",)))
            value = args[position] if len(args) > position else next(kwargs[k] for k in keys if k in kwargs)
            size = _bytes(value)
            RECORDED.append({"name": name, "ranks": ranks, "bytes": size})
        return original(*args, **kwargs)
    return call


# installed before DeepSpeed binds torch.distributed's functions (its comm backend keeps references to them)
for _name in COLLECTIVES:
    if hasattr(dist, _name):
        setattr(dist, _name, _counting(_name, getattr(dist, _name)))

from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.trainer.trainer import Trainer  # noqa: E402


class SavedForBackward:
    """The storages each micro-batch's forward saves for backward (torch's saved-tensor hooks), each counted once,
    parameters left out; each attributed to the decoder layers or to the rest, by the module running when it was
    saved. A micro-batch's saved tensors are freed by its backward, so the step holds one micro-batch's at a time."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.data_ptr() for p in model.parameters() if p.numel()} | {id(p) for p in model.parameters()}
        self.batches: list[dict[int, tuple[int, str]]] = []
        self.region = "rest"
        self.handles = [model.register_forward_pre_hook(lambda *_: self.batches.append({}))]
        for layer in model.model.layers:
            self.handles.append(layer.register_forward_pre_hook(lambda *_: self._enter("layers")))
            self.handles.append(layer.register_forward_hook(lambda *_: self._enter("rest")))

    def _enter(self, region: str) -> None:
        self.region = region

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) in self.params or id(base) in self.params or isinstance(base, torch.nn.Parameter):
            return tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.params or storage.nbytes() == 0 or not self.batches:
            return tensor
        self.batches[-1].setdefault(storage.data_ptr(), (storage.nbytes(), self.region))
        return tensor

    def totals(self) -> dict[str, int]:
        """The largest micro-batch's saved bytes, in the layers and in the rest."""
        found = []
        for batch in self.batches:
            regions = {"layers": 0, "rest": 0}
            for size, region in batch.values():
                regions[region] += size
            found.append(regions)
        return max(found, key=lambda regions: regions["layers"] + regions["rest"])

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class GatheredPeak:
    """The most bytes of ZeRO-3 parameters gathered at once (status AVAILABLE, persistent ones left out), looked at
    before and after every module's forward and backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.available = ZeroParamStatus.AVAILABLE
        self.params = [p for p in model.parameters() if not getattr(p, "ds_persist", False)]
        self.peak = 0
        self.handles = []
        for module in model.modules():
            self.handles += [module.register_forward_pre_hook(self.look), module.register_forward_hook(self.look),
                             module.register_full_backward_hook(self.look)]

    def look(self, *_) -> None:
        live = sum(p.ds_numel * p.ds_tensor.element_size() for p in self.params if p.ds_status == self.available)
        self.peak = max(self.peak, live)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def model_states(trainer: Trainer) -> dict:
    engine = trainer.parts.engine
    optimizer = engine.optimizer
    params = [{"name": name, "ds_numel": int(p.ds_numel), "partition_numel": int(p.ds_tensor.numel()),
               "dtype": str(p.ds_tensor.dtype), "persistent": bool(getattr(p, "ds_persist", False))}
              for name, p in engine.module.named_parameters()]
    lp_ptrs = {p.ds_tensor.untyped_storage().data_ptr() for _, p in engine.module.named_parameters()}
    fp32 = [{"numel": t.numel(), "dtype": str(t.dtype), "shares_params": t.untyped_storage().data_ptr() in lp_ptrs}
            for t in optimizer.fp32_partitioned_groups_flat]
    moments = []
    for state in optimizer.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                moments.append({"key": key, "numel": value.numel(), "dtype": str(value.dtype)})
    grads = optimizer.grad_partitions_flat_buffer
    return {"params": params, "fp32": fp32, "moments": moments,
            "grad_buffer": {"numel": grads.numel(), "dtype": str(grads.dtype)}}


def tensor_bytes(value, seen: dict[int, int]) -> int:
    """The bytes of the tensors inside `value` (dicts, lists), each storage once (`seen`: storage -> bytes)."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    elif isinstance(value, dict):
        for item in value.values():
            tensor_bytes(item, seen)
    elif isinstance(value, (list, tuple)):
        for item in value:
            tensor_bytes(item, seen)
    return sum(seen.values())


def checkpoint_files(folder: Path) -> dict:
    """Every file of a saved checkpoint: its size, and for torch files the bytes of the tensors it holds."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        entry = {"size": path.stat().st_size}
        if path.suffix == ".pt":
            entry["tensor_bytes"] = tensor_bytes(torch.load(path, map_location="cpu", weights_only=False), {})
        files[str(path.relative_to(folder))] = entry
    return files


def run_case(out: Path, config: str, name: str, overrides: list[str]) -> None:
    global RECORDED
    folder = out / name
    trainer = Trainer(load_config(config, [*overrides, f"train.output_dir={folder / 'run'}"]))
    trainer.train_step()  # warm-up: ZeRO-3 traces the parameter order on the first step
    module = trainer.parts.engine.module
    head = module.get_output_embeddings()
    logits: list[dict] = []

    def record_output(_module, _args, output) -> None:
        if isinstance(output, torch.Tensor):
            logits.append({"shape": list(output.shape), "dtype": str(output.dtype)})

    hook = head.register_forward_hook(record_output)
    saved = SavedForBackward(module)
    gathered = GatheredPeak(module)
    RECORDED = []
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        trainer.train_step()
    collectives, RECORDED = RECORDED, None
    hook.remove()
    saved.close()
    gathered.close()
    states = model_states(trainer)
    dist.barrier()
    tag = trainer.save_checkpoint()
    dist.barrier()
    result = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "model_states": states,
              "saved": saved.totals(), "gathered_peak": gathered.peak, "logits": logits, "collectives": collectives}
    if dist.get_rank() == 0:
        result["checkpoint"] = {"tag": tag, "files": checkpoint_files(folder / "run" / tag)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    with contextlib.suppress(AttributeError):
        trainer.parts.lock.release()
    del trainer
    gc.collect()
    dist.barrier()


def main() -> None:
    out, config, cases_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    for case in json.loads(Path(cases_file).read_text()):
        run_case(out, config, case["name"], case["overrides"])


if __name__ == "__main__":
    distributed.run_process(main)
