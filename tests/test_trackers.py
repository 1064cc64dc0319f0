"""Weights & Biases and MLflow beside TensorBoard (`monitor.wandb`, `monitor.mlflow`).

One launched 2-process run of the demo logs to all three: W&B offline into the run folder, MLflow into a local file
store. Each tracker's values, read back with its own reader, equal TensorBoard's at every step and tag (train/*,
val/*, eval/*); only global rank 0 logs (one run each); the config and the text reach both. The fast tests: the
keys are validated at load, a missing library is one line naming the install.
"""

from __future__ import annotations

import numpy
import pytest

from helpers.launch import demo_args, deepspeed_command, launch_env, run, run_ok
from helpers.tensorboard import scalars as tensorboard_scalars, tensor_tags
from helpers.trackers import mlflow_run, mlflow_scalars, mlflow_text_files, wandb_config, wandb_records, wandb_scalars
from ntl_pretrain.config import ConfigError, load_config
from ntl_pretrain.observability import trackers
from ntl_pretrain.observability.monitor import Monitor, MonitorError

TIMEOUT = 420
EXPERIMENT = "ntl-test"


@pytest.fixture(scope="module")
def tracked_run(assets, tmp_path_factory):
    base = tmp_path_factory.mktemp("tracked")
    out, store = base / "run", f"file://{base / 'mlruns'}"
    env = launch_env(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(base / "wandb_config"),
                     WANDB_CACHE_DIR=str(base / "wandb_cache"), WANDB_DATA_DIR=str(base / "wandb_data"))
    run_ok(deepspeed_command(2, *demo_args(
        assets, out, "train.max_steps=4", "train.log_every_n_steps=2", "train.val_every_n_steps=2",
        "checkpoint.every_n_steps=0", "eval.at_end=true", "eval.arithmetic_n=4",
        "eval.arithmetic_splits=[interpolation]", "eval.arithmetic_train_digits=[1, 2]",
        "eval.arithmetic_extrapolation_digits=[3, 3]", "eval.samples_to_log=2",
        "monitor.wandb.enabled=true", "monitor.wandb.mode=offline", "monitor.wandb.project=ntl-test",
        "monitor.mlflow.enabled=true", f"monitor.mlflow.tracking_uri={store}",
        f"monitor.mlflow.experiment={EXPERIMENT}")), env=env, timeout=TIMEOUT)
    return out, store


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT)
def test_wandb_and_mlflow_log_what_tensorboard_logs(tracked_run):
    out, store = tracked_run
    expected = tensorboard_scalars(out / "tensorboard")
    assert {"train/loss", "val/loss", "val/sources.0/loss"} <= set(expected), expected  # the mixture's and a source's
    assert any(tag.startswith("eval/") for tag in expected), expected
    assert [step for step, _ in expected["train/loss"]] == [1, 2, 4]  # the logging steps only
    [wandb_run] = (out / "wandb").glob("offline-run-*")  # global rank 0 only: one run
    for name, logged in (("W&B", wandb_scalars(wandb_run)), ("MLflow", mlflow_scalars(store, EXPERIMENT))):
        assert sorted(logged) == sorted(expected), name
        for tag, points in expected.items():
            assert [step for step, _ in logged[tag]] == [step for step, _ in points], (name, tag)
            # TensorBoard keeps float32, the trackers the float64 logged: equal once rounded to float32
            assert [float(numpy.float32(value)) for _, value in logged[tag]] == [value for _, value in points], \
                (name, tag)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT)
def test_trackers_get_the_config_and_the_text_and_end_finished(tracked_run):
    out, store = tracked_run
    [wandb_run] = (out / "wandb").glob("offline-run-*")
    assert wandb_config(wandb_run)["train"]["max_steps"] == 4
    client, run = mlflow_run(store, EXPERIMENT)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"  # named after the run folder
    assert run.data.params["train.max_steps"] == "4" and run.data.params["monitor.mlflow.experiment"] == EXPERIMENT
    # every text TensorBoard has (the config, the DeepSpeed config, the evaluation's samples) is a file of both,
    # text/<tag>_step<step>.md
    text_tags = {tag.removesuffix("/text_summary") for tag in tensor_tags(out / "tensorboard")}
    assert {"config", "deepspeed_config", "eval/samples/arith"} <= text_tags, text_tags
    wandb_texts = {path.relative_to(wandb_run / "files" / "text").as_posix()
                   for path in (wandb_run / "files" / "text").rglob("*.md")}
    for name, files in (("W&B", wandb_texts), ("MLflow", mlflow_text_files(store, EXPERIMENT))):
        assert {file.rsplit("_step", 1)[0] for file in files} == text_tags, (name, files)


@pytest.mark.fast
def test_tracker_keys_are_checked_at_load():
    with pytest.raises(ConfigError, match=r"monitor\.wandb\.mode=.*online, offline, disabled"):
        load_config("configs/demo.yaml", ["monitor.wandb.mode=cloud"])
    with pytest.raises(ConfigError, match=r"monitor\.mlflow\.experiment is empty.*monitor\.mlflow\.enabled=false"):
        load_config("configs/demo.yaml", ["monitor.mlflow.enabled=true", "monitor.mlflow.experiment="])
    with pytest.raises(ConfigError, match=r"did you mean 'monitor\.wandb\.project'"):
        load_config("configs/demo.yaml", ["monitor.wandb.projet=x"])
    config = load_config("configs/demo.yaml", [])
    assert not config.monitor.wandb.enabled and not config.monitor.mlflow.enabled  # off by default


@pytest.mark.fast
def test_a_missing_tracker_library_is_one_line_naming_the_install(monkeypatch):
    config = load_config("configs/demo.yaml", ["monitor.mlflow.enabled=true"])
    trackers.check_tracker_libraries(config.monitor)  # installed here (the dev extra)
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", trackers.Tracker(
        module="mlflow_not_installed_here", install="pip install mlflow-skinny", writer=trackers.MlflowWriter))
    with pytest.raises(ConfigError) as error:
        trackers.check_tracker_libraries(config.monitor)
    assert "\n" not in str(error.value) and "pip install mlflow-skinny" in str(error.value)
    assert "monitor.mlflow.enabled=false" in str(error.value)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("outcome, mlflow_status, wandb_exit_code",
                         [("stopped", "KILLED", 0), ("failed", "FAILED", 1)])
def test_the_trackers_record_how_the_run_ended(tmp_path, monkeypatch, outcome, mlflow_status, wandb_exit_code):
    """A run stopped by a signal or ended by an error closes both trackers (the trainer's `_finish` and cli's
    `close_after_failure`); each records the end, and a second close does nothing."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wcfg"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wcache"), "WANDB_DATA_DIR": str(tmp_path / "wdata")}.items():
        monkeypatch.setenv(name, value)
    store, out = f"file://{tmp_path / 'mlruns'}", tmp_path / "run"
    config = load_config("configs/demo.yaml", [
        f"train.output_dir={out}", "monitor.wandb.enabled=true", "monitor.wandb.mode=offline",
        "monitor.mlflow.enabled=true", f"monitor.mlflow.tracking_uri={store}", f"monitor.mlflow.experiment={EXPERIMENT}"])
    monitor = Monitor(True, str(out / "tensorboard"), total_steps=2, progress_bar="never", settings=config.monitor,
                      output_dir=str(out))
    monitor.log_step(1, {"train/loss": 2.5})
    monitor.close(outcome)
    monitor.close("failed")  # closed already: nothing changes
    _, run = mlflow_run(store, EXPERIMENT)
    assert run.info.status == mlflow_status
    assert mlflow_scalars(store, EXPERIMENT) == {"train/loss": [(1, 2.5)]}
    [wandb_run] = (out / "wandb").glob("offline-run-*")
    assert wandb_scalars(wandb_run) == {"train/loss": [(1, 2.5)]}
    [path] = wandb_run.glob("run-*.wandb")
    exits = [record.exit.exit_code for record in wandb_records(path) if record.WhichOneof("record_type") == "exit"]
    assert exits == [wandb_exit_code]


@pytest.mark.timeout(120)
def test_a_tracker_that_cannot_start_is_one_line_naming_its_keys(tmp_path):
    config = load_config("configs/demo.yaml", [f"train.output_dir={tmp_path / 'run'}", "monitor.mlflow.enabled=true",
                                               "monitor.mlflow.tracking_uri=nosuchscheme://host/x"])
    with pytest.raises(MonitorError) as error:
        Monitor(True, str(tmp_path / "run" / "tensorboard"), total_steps=2, progress_bar="never",
                settings=config.monitor, output_dir=str(tmp_path / "run"))
    message = str(error.value)
    assert "\n" not in message and "MLflow (monitor.mlflow) could not start" in message, message
    assert "nosuchscheme" in message and "monitor.mlflow.enabled=false" in message, message


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT)
def test_a_tracker_that_cannot_start_stops_every_rank_with_one_line(assets, tmp_path):
    result = run(deepspeed_command(2, *demo_args(
        assets, tmp_path / "run", "train.max_steps=2", "monitor.mlflow.enabled=true",
        "monitor.mlflow.tracking_uri=nosuchscheme://host/x")), timeout=TIMEOUT)
    assert result.returncode != 0, result.stdout[-3000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "could not start" in line]
    assert len(lines) == 1 and "monitor.mlflow.enabled=false" in lines[0], result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.fast
def test_an_mlflow_database_store_without_sqlalchemy_names_the_install(monkeypatch, dry_run_here, tmp_path):
    """Issue 47: `sqlite://` with mlflow-skinny (no SQLAlchemy) ended in MLflow's message about its store registry;
    the fix (the full mlflow package) was only in the docs. Refused at start-up and in the dry run."""
    import sys

    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as mlflow-skinny leaves it: not importable
    result = dry_run_here("--config", "configs/demo.yaml", f"train.output_dir={tmp_path / 'run'}",
                          "monitor.mlflow.enabled=true", "monitor.mlflow.tracking_uri=sqlite:///mlflow.db")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2 and errors == [
        "error: monitor.mlflow.tracking_uri='sqlite:///mlflow.db' is a database store, which needs SQLAlchemy (not "
        "installed: mlflow-skinny leaves it out): pip install mlflow (the full package), or use a server "
        "(http://HOST:5000) or a folder (file:///path/mlruns)"], result.stderr[-2000:]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql+psycopg2://db/mlflow")
    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI='postgresql\+psycopg2://db/mlflow' is a database"):
        trackers.check_mlflow_store(None)
    trackers.check_mlflow_store("file:///tmp/mlruns")  # a folder or a server needs no SQLAlchemy
    trackers.check_mlflow_store("http://host:5000")


@pytest.mark.fast
@pytest.mark.timeout(60)
def test_wandb_online_without_a_route_is_one_line_naming_offline_within_seconds(tmp_path, monkeypatch):
    """Issue 47: W&B online with a key but no route to its server waited wandb.init's 90 s in silence, then
    relayed a hint about a setting the config has no key for; now the server is tried first, and the line names
    monitor.wandb.mode=offline."""
    import socket
    import time

    from helpers.distributed import free_port

    port = free_port()  # nothing listens there
    for name in trackers.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_API_KEY": "x" * 40,
                        "WANDB_CONFIG_DIR": str(tmp_path / "wcfg"), "WANDB_CACHE_DIR": str(tmp_path / "wcache"),
                        "WANDB_DATA_DIR": str(tmp_path / "wdata")}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    config = load_config("configs/demo.yaml", [f"train.output_dir={tmp_path / 'run'}", "monitor.wandb.enabled=true",
                                               "monitor.wandb.mode=online"])
    started = time.monotonic()
    with pytest.raises(MonitorError) as error:
        Monitor(True, str(tmp_path / "run" / "tensorboard"), total_steps=2, progress_bar="never",
                settings=config.monitor, output_dir=str(tmp_path / "run"))
    message = str(error.value)
    assert time.monotonic() - started < trackers.WANDB_ROUTE_TIMEOUT_S
    assert "\n" not in message and f"W&B's server 127.0.0.1:{port} (WANDB_BASE_URL) cannot be reached" in message
    assert "set monitor.wandb.mode=offline" in message and "init_timeout" not in message, message


@pytest.mark.fast
def test_a_wandb_dir_that_cannot_be_a_folder_is_named_at_start_up(tmp_path):
    """`monitor.wandb.dir=/dev/null` reached W&B as "File exists", naming neither the key nor the fix."""
    from ntl_pretrain.trainer.preflight import output_problems

    config = load_config("configs/demo.yaml", [f"train.output_dir={tmp_path / 'run'}", "monitor.wandb.enabled=true",
                                               "monitor.wandb.mode=offline", "monitor.wandb.dir=/dev/null"])
    assert output_problems(config) == ("monitor.wandb.dir='/dev/null' cannot be created: '/dev/null' is a file, not a "
                                       "folder; choose another monitor.wandb.dir")
    assert output_problems(load_config("configs/demo.yaml", [f"train.output_dir={tmp_path / 'run'}",
                                                             "monitor.wandb.dir=/dev/null"])) is None  # W&B off
