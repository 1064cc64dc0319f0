"""A run's Weights & Biases and MLflow records read back: W&B's offline run file (its record log, parsed with
W&B's own protobuf messages) and an MLflow store through `MlflowClient`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# W&B's transaction log (the .wandb file): a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB's log
# format: 32 KiB blocks of records, each a 7-byte header (CRC-32C, little-endian length, type) and its bytes;
# a record longer than its block's rest is split into FIRST, MIDDLE..., LAST pieces.
WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every record of an offline run's .wandb file, as W&B's `Record` messages."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data.startswith(WANDB_HEADER), f"{path} is not a W&B run file (header {data[:7]!r})"
    records, pending, offset = [], b"", len(WANDB_HEADER)
    while offset + 7 <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < 7:  # a block's tail too short for a header is padding
            offset += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        if kind == 0 and length == 0:  # zero padding up to the block's end
            offset += left_in_block
            continue
        piece = data[offset + 7:offset + 7 + length]
        offset += 7 + length
        pending = piece if kind in (FULL, FIRST) else pending + piece
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every number logged to the W&B run in `run_dir` (an offline-run-* folder): tag -> (step, value) points."""
    [path] = run_dir.glob("run-*.wandb")
    points: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        for item in record.history.item:
            tag = item.key or "/".join(item.nested_key)
            value = json.loads(item.value_json)
            if not tag.startswith("_") and isinstance(value, (int, float)):
                points.setdefault(tag, []).append((step, float(value)))
    return points


def wandb_config(run_dir: Path) -> dict:
    """The W&B run's configuration (its last config record: key -> value)."""
    [path] = run_dir.glob("run-*.wandb")
    config = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
    return config


def mlflow_run(tracking_uri: str, experiment: str):
    """The one run of `experiment` in the MLflow store at `tracking_uri`, and the client that read it."""
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow refuses its file store unless asked
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {tracking_uri}"
    [run] = client.search_runs([found.experiment_id])
    return client, run


def mlflow_text_files(tracking_uri: str, experiment: str) -> set[str]:
    """The paths of that run's artifacts under text/ (relative to it), from a local store's artifact folder."""
    from urllib.parse import urlparse

    _, run = mlflow_run(tracking_uri, experiment)
    root = Path(urlparse(run.info.artifact_uri).path) / "text"
    return {path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file()}


def mlflow_scalars(tracking_uri: str, experiment: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of that run: tag -> (step, value) points in step order."""
    client, run = mlflow_run(tracking_uri, experiment)
    return {tag: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
            for tag in run.data.metrics}
