"""The layout's arithmetic (`parallel_layout.ParallelLayout`) against DeepSpeed's own group construction, run
for every rank of a few worlds without processes (deepspeed.comm's rank, world size and `new_group` stood in
for, so each group is its list of ranks), and the refusals of parallel.sp_size. That the groups a real engine
built match the layout is checked by `ParallelGroups.from_deepspeed` in every trainer start, and against
DeepSpeed's engine in tests/workers/trainer_step.py."""

from __future__ import annotations

import pytest

from ntl_pretrain.config import ConfigError
from ntl_pretrain.parallel.layout import ParallelLayout, check_sequence_parallel

pytestmark = pytest.mark.fast


@pytest.fixture
def fake_comm(monkeypatch):
    """deepspeed.comm as seen by global rank `rank` of `world` processes: `new_group(ranks)` returns the ranks."""
    import deepspeed.comm as ds_comm

    def enter(world: int, rank: int) -> None:
        monkeypatch.setattr(ds_comm, "is_initialized", lambda: True)
        monkeypatch.setattr(ds_comm, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(ds_comm, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(ds_comm, "new_group", lambda ranks, *args, **kwargs: tuple(sorted(ranks)))

    return enter


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2), (4, 2), (8, 2), (8, 4), (6, 3)])
def test_tensor_parallel_ranks_are_deepspeeds_autotp_groups(fake_comm, monkeypatch, world: int, tp: int):
    from deepspeed.utils import groups

    for rank in range(world):
        fake_comm(world, rank)
        for name in ("_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
            monkeypatch.setattr(groups, name, None)
        groups._init_tp_groups_with_new_group(tp)  # the mesh DeepSpeed's AutoTP builds, as rank lists
        layout = ParallelLayout.of(world, rank, rank, tp_size=tp)
        assert layout.peers("tp") == groups._TENSOR_MODEL_PARALLEL_GROUP
        assert layout.peers("dp") == layout.peers("loss") == groups._DATA_PARALLEL_GROUP
        assert layout.peers("sp") == (rank,)
        assert (layout.tp_rank, layout.dp_rank, layout.sp_rank) == (rank % tp, rank // tp, 0)
        assert (layout.data_rank, layout.data_size, layout.grad_average_size) == (rank // tp, world // tp, world // tp)
        assert layout.global_rank(layout.dp_rank, layout.sp_rank, layout.tp_rank) == rank


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2), (8, 4), (6, 3), (6, 2)])
def test_sequence_parallel_ranks_are_deepspeeds_ulysses_groups(fake_comm, world: int, sp: int):
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    for rank in range(world):
        fake_comm(world, rank)
        parallel_state_sp._release_sequence_parallel_groups()
        parallel_state_sp.initialize_sequence_parallel(sp)
        try:
            sp_group = parallel_state_sp.get_sequence_parallel_group()
            loss_group = parallel_state_sp.get_sequence_data_parallel_group()
        finally:
            parallel_state_sp._release_sequence_parallel_groups()
        layout = ParallelLayout.of(world, rank, rank, tp_size=1, sp_size=sp)
        assert layout.peers("sp") == sp_group and layout.peers("loss") == loss_group
        assert (layout.sp_rank, layout.dp_rank, layout.dp_size) == (rank % sp, rank // sp, world // sp)
        # sp peers read the same samples (each its slice of the sequence); the dp group: one rank per sequence slice
        assert layout.peers("dp") == tuple(range(rank % sp, world, sp))
        assert (layout.data_rank, layout.data_size, layout.loss_size) == (rank // sp, world // sp, world)
        # ZeRO-3 divides the sum over dp x sp by dp x sp (tests/test_sequence_parallel.py measures it)
        assert layout.grad_average_size == len(loss_group)
        assert layout.peers("tp") == (rank,)


@pytest.mark.parametrize("world,tp,sp,match", [
    (4, 2, 2, r"parallel.sp_size=2 with parallel.tp_size=2: .*DeepSpeed 0.19.8 .*no tensor-parallel dimension"),
    (4, 1, 3, r"parallel.sp_size=3 does not divide the world size 4 .*one of 1, 2, 4"),
    (6, 3, 4, r"parallel.sp_size=4 with parallel.tp_size=3"),
    (2, 1, 0, r"parallel.sp_size must be >= 1, got 0"),
])
def test_sequence_parallel_sizes_that_do_not_fit_are_refused(world: int, tp: int, sp: int, match: str):
    with pytest.raises(ConfigError, match=match):
        check_sequence_parallel(world, tp, sp)
    with pytest.raises(ConfigError, match=match):
        ParallelLayout.of(world, 0, 0, tp_size=tp, sp_size=sp)


def test_sp_size_is_a_config_key_and_tp_beside_it_is_refused(tmp_path):
    from ntl_pretrain.config import load_config
    from ntl_pretrain.trainer.preflight import preflight

    cfg = load_config("configs/demo.yaml", [f"train.output_dir={tmp_path}", "parallel.sp_size=2"])
    assert cfg.parallel.sp_size == 2 and cfg.parallel.tp_size == "auto"  # auto: tp 1 beside sp
    checked = preflight(cfg, 2, on_cpu=True, local_files_only=True)
    assert (checked.run.cfg.parallel.tp_size, checked.run.ds_config["sequence_parallel_size"]) == (1, 2)
    tp2 = load_config("configs/demo.yaml", [f"train.output_dir={tmp_path}", "parallel.sp_size=2", "parallel.tp_size=2"])
    with pytest.raises(ConfigError, match=r"parallel.sp_size=2 with parallel.tp_size=2: .*no tensor-parallel dimension"):
        preflight(tp2, 4, on_cpu=True, local_files_only=True)
    with pytest.raises(ConfigError, match=r"parallel.sp_size must be >= 1, got 0"):
        load_config("configs/demo.yaml", ["parallel.sp_size=0"])
