"""The experiment trackers beside TensorBoard: Weights & Biases and MLflow, each switched on in the run config's
`monitor` section (`monitor.wandb`, `monitor.mlflow`; off by default).

Every writer of a run, TensorBoard's included, has the calls of TensorBoard's `SummaryWriter` that the run uses
(`add_scalar`, `add_text`, `flush`) plus `add_config` (the resolved run config, a nested mapping) and
`close(outcome)`; `Monitor` sends each figure to all of
them, so the trackers get exactly the tags and values TensorBoard gets, at the same steps (the logging steps).
`TRACKERS` is the table of the optional ones: the config section's name -> its library, install line and writer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..config import ConfigError, MonitorConfig

class TensorBoardWriter:
    """TensorBoard's `SummaryWriter` with the writers' common calls (its config is the `config` text already)."""

    name = "TensorBoard"

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.where = log_dir
        self.summary = SummaryWriter(log_dir=log_dir)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.summary.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.summary.add_text(tag, text, step)

    def add_config(self, config: Mapping[str, Any]) -> None:
        pass

    def flush(self) -> None:
        self.summary.flush()

    def close(self, outcome: str) -> None:
        self.summary.flush()
        self.summary.close()


class _StepBuffer:
    """The scalars of one step, sent together when the step changes or at a flush (one call per logging step)."""

    def __init__(self, send: Callable[[int, dict[str, float]], None]) -> None:
        self._send, self._step, self._scalars = send, None, {}

    def add(self, tag: str, value: float, step: int) -> None:
        if self._step is not None and step != self._step:
            self.flush()
        self._step = step
        self._scalars[tag] = float(value)

    def flush(self) -> None:
        if self._scalars:
            step, scalars, self._step, self._scalars = self._step, self._scalars, None, {}
            self._send(step, scalars)


class WandbWriter:
    """A Weights & Biases run (online, or offline into `dir`/wandb for a later `wandb sync`)."""

    name = "Weights & Biases"

    def __init__(self, settings: Any, output_dir: str, run_name: str) -> None:
        import wandb

        folder = settings.dir or output_dir
        os.makedirs(folder, exist_ok=True)
        if settings.mode == "online":
            check_wandb_route()
        self.run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or run_name,
                              mode=settings.mode, dir=folder, tags=list(settings.tags) or None, reinit="create_new")
        self.where = f"{settings.mode} run {self.run.id} in {folder}" if settings.mode != "online" else self.run.url
        self._buffer = _StepBuffer(lambda step, scalars: self.run.log(scalars, step=step))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._buffer.add(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        # a file of the run (W&B's Files tab; uploaded with it): W&B has no text panel of its own
        path = os.path.join(self.run.dir, "text", f"{tag}_step{step}.md")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)

    def add_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def flush(self) -> None:
        self._buffer.flush()

    def close(self, outcome: str) -> None:
        self._buffer.flush()
        self.run.finish(exit_code=1 if outcome == "failed" else 0)


WANDB_DEFAULT_URL = "https://api.wandb.ai"
WANDB_ROUTE_TIMEOUT_S = 10.0
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def check_wandb_route(timeout_s: float = WANDB_ROUTE_TIMEOUT_S) -> None:
    """An online W&B run on a machine with no route to W&B's server waited wandb.init's 90 s in silence, then
    relayed a hint about a setting the run config has no key for: a TCP connection to the server (WANDB_BASE_URL)
    is tried first, for at most `timeout_s`, and its failure is one line naming monitor.wandb.mode=offline. Behind
    a proxy (its variables set) the direct connection says nothing, so wandb.init is left to try."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    url = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL)
    if not url.hostname:
        return  # not a URL: wandb.init names it
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigError(f"monitor.wandb.mode=online, but W&B's server {host}:{port} (WANDB_BASE_URL) cannot be "
                          f"reached from here within {timeout_s:g} s ({error.strerror or error}); on a machine without "
                          f"that route set monitor.wandb.mode=offline (upload later with `wandb sync`), or "
                          f"monitor.wandb.enabled=false") from None


# how a run ended (`Monitor.close`'s outcome) -> MLflow's run status
MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
MLFLOW_PARAM_CHARS = 6000  # MLflow refuses longer parameter values


class MlflowWriter:
    """An MLflow run in `tracking_uri`'s store (a server, a database or a local file store)."""

    name = "MLflow"

    def __init__(self, settings: Any, output_dir: str, run_name: str) -> None:
        uri = settings.tracking_uri
        if uri is not None and (uri.startswith("file:") or "://" not in uri):
            # MLflow refuses its file store unless asked for it; a configured local folder is that request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name or run_name).info.run_id
        self.where = f"run {self.run_id} of experiment {settings.experiment!r} at {self.client.tracking_uri}"
        self._buffer = _StepBuffer(self._send)

    def _send(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, step) for tag, value in scalars.items()])

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._buffer.add(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"text/{tag}_step{step}.md")

    def add_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, _param_text(value)) for key, value in _flat(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def flush(self) -> None:
        self._buffer.flush()

    def close(self, outcome: str) -> None:
        self._buffer.flush()
        self.client.set_terminated(self.run_id, MLFLOW_STATUS[outcome])


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"seed": 1}} -> {"train.seed": 1}: MLflow's parameters are flat (lists stay one value)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MLFLOW_PARAM_CHARS else text[:MLFLOW_PARAM_CHARS - 3] + "..."


@dataclass(frozen=True)
class Tracker:
    """One optional tracker: its library (module and install line) and its writer."""

    module: str
    install: str
    writer: type


# the config section's name under `monitor` -> the tracker
TRACKERS = {
    "wandb": Tracker(module="wandb", install="pip install wandb", writer=WandbWriter),
    "mlflow": Tracker(module="mlflow", install="pip install mlflow-skinny", writer=MlflowWriter),
}


def enabled_trackers(monitor: MonitorConfig) -> list[tuple[str, Tracker]]:
    return [(name, tracker) for name, tracker in TRACKERS.items() if getattr(monitor, name).enabled]


def check_tracker_libraries(monitor: MonitorConfig) -> None:
    """Every switched-on tracker's library imports here (the start-up check of every rank, before anything is
    built): else one line naming the key and the install."""
    for name, tracker in enabled_trackers(monitor):
        if importlib.util.find_spec(tracker.module) is None:
            raise ConfigError(f"monitor.{name}.enabled=true needs the {tracker.module} library, which is not installed: "
                              f"{tracker.install} (or pip install 'ntl-pretrain[tracking]'), or set "
                              f"monitor.{name}.enabled=false")
    if monitor.mlflow.enabled:
        check_mlflow_store(monitor.mlflow.tracking_uri)


MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's database stores (SQLAlchemy URIs)


def check_mlflow_store(tracking_uri: str | None) -> None:
    """A database store (sqlite://, postgresql://, ...) needs SQLAlchemy, which mlflow-skinny leaves out: MLflow's own
    message named its registry, not the install; refused here in one line."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in MLFLOW_DATABASES and importlib.util.find_spec("sqlalchemy") is None:
        key = "monitor.mlflow.tracking_uri" if tracking_uri else "MLFLOW_TRACKING_URI"
        raise ConfigError(f"{key}={uri!r} is a database store, which needs SQLAlchemy (not installed: mlflow-skinny "
                          f"leaves it out): pip install mlflow (the full package), or use a server (http://HOST:5000) "
                          f"or a folder (file:///path/mlruns)")


def open_trackers(monitor: MonitorConfig, output_dir: str) -> list[Any]:
    """A writer for each switched-on tracker (the run named after its folder); one that cannot start closes those
    started before it and raises `TrackerStartError` naming its keys."""
    run_name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    writers: list[Any] = []
    for name, tracker in enabled_trackers(monitor):
        try:
            writers.append(tracker.writer(getattr(monitor, name), output_dir, run_name))
        except Exception as error:
            for writer in writers:
                writer.close("failed")
            reason = " ".join(str(error).split()) or type(error).__name__
            raise TrackerStartError(f"{tracker.writer.name} (monitor.{name}) could not start: {reason}; fix "
                                    f"monitor.{name}.*, or set monitor.{name}.enabled=false") from error
    return writers


class TrackerStartError(RuntimeError):
    """A switched-on tracker could not start (the monitor reports it as one line)."""
