"""A run's TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path


def _accumulator(tensorboard_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalars(tensorboard_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag: its (step, value) points in order (TensorBoard drops points a restart purged)."""
    accumulator = _accumulator(tensorboard_dir)
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def values(tensorboard_dir: Path) -> dict[str, list[float]]:
    """Every scalar tag: its values in step order."""
    return {tag: [v for _, v in points] for tag, points in scalars(tensorboard_dir).items()}


def tensor_tags(tensorboard_dir: Path) -> list[str]:
    """The tags of the tensor (text) summaries, e.g. the logged config."""
    return _accumulator(tensorboard_dir).Tags()["tensors"]
