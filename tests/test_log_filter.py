"""ntl_pretrain/runtime/log_filter.py: the libraries' known-harmless output is dropped where it is raised (the real torch
deprecation, DeepSpeed's scheduler warning and op message, huggingface_hub's save line), other warnings of the same
modules still show, and `verbose` keeps everything."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import REPO, free_port
from ntl_pretrain.runtime import log_filter
from ntl_pretrain.checkpoint.format import STAGING_SUFFIX

pytestmark = pytest.mark.fast


@pytest.fixture
def filtered(monkeypatch):
    """install(), undone after the test (warning filters, logger filters, stdout, the conversion's tqdm)."""
    import deepspeed.checkpoint.ds_to_universal as conversion

    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(conversion, "tqdm", conversion.tqdm)
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "")  # restored to what it was after the test
    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS")
    loggers = [logging.getLogger(known.logger) for known in log_filter.KNOWN_RECORDS]
    before = {id(logger): list(logger.filters) for logger in loggers}
    with warnings.catch_warnings():
        yield log_filter.install
    for logger in loggers:
        logger.filters[:] = before[id(logger)]


def _one_process_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _torch_deprecation_warnings() -> list[str]:
    _one_process_group()
    with warnings.catch_warnings(record=True) as caught:  # the filters as they are (FutureWarning: shown)
        dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))
        warnings.warn("a real warning of the caller", FutureWarning, stacklevel=1)
    return [str(w.message) for w in caught]


def _records(name: str, emit) -> list[str]:
    """The messages that `emit()` logs on logger `name` and that pass its filters."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        emit()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return seen


def _library_records() -> list[str]:
    from deepspeed.runtime.lr_schedules import WarmupLR

    def deepspeed() -> None:
        scheduler = WarmupLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), warmup_num_steps=2)
        scheduler.last_batch_iteration = -1
        scheduler.get_lr()  # DeepSpeed's own warning: its schedulers start at iteration -1
        logging.getLogger("DeepSpeed").warning("a real DeepSpeed warning")

    def hub() -> None:  # the line huggingface_hub's save_torch_state_dict logs (into the export's staging folder)
        log = logging.getLogger("huggingface_hub.serialization._torch")
        log.info(f"Model weights successfully saved to /run/hf_export{STAGING_SUFFIX}!")
        log.info("Model weights successfully saved to /run/hf_export!")

    return _records("DeepSpeed", deepspeed) + _records("huggingface_hub.serialization._torch", hub)


def test_known_harmless_output_is_dropped_and_real_warnings_kept(filtered, capsys):
    filtered(verbose=False)
    assert _torch_deprecation_warnings() == ["a real warning of the caller"]
    assert _library_records() == ["a real DeepSpeed warning", "Model weights successfully saved to /run/hf_export!"]
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().create_op_builder("ShareMemCommBuilder").absolute_name()
    print(f"DeepSpeed {name} built successfully")  # DeepSpeed's own line (deepspeed/comm/torch.py)
    print("step 1: loss=1.0")
    assert capsys.readouterr().out == "step 1: loss=1.0\n"
    import deepspeed.checkpoint.ds_to_universal as conversion

    stream = io.StringIO()
    list(conversion.tqdm.tqdm(range(3), file=stream))
    assert stream.getvalue() == ""


def test_verbose_keeps_everything(filtered, monkeypatch):
    hidden_before = _torch_deprecation_warnings()
    filtered(verbose=True)
    assert _torch_deprecation_warnings() == hidden_before and len(hidden_before) == 2
    shown = _library_records()
    assert "Attempting to get learning rate from scheduler before it has started" in shown
    assert f"Model weights successfully saved to /run/hf_export{STAGING_SUFFIX}!" in shown


def test_the_launcher_runs_quietly_unless_verbose():
    from ntl_pretrain.runtime.supervisor import with_quiet_launcher

    args = ["--num_gpus", "2", "launch/pretrain.sh", "--config", "c.yaml"]
    assert with_quiet_launcher(args) == ["--log_level", "warning", *args]
    for own in (["--log_level", "info", *args], [*args, "--verbose"], ["-q", *args]):
        assert with_quiet_launcher(own) == own


def teardown_module():
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_runner_and_autotp_notes_of_every_run_are_dropped_and_datasets_bars_off_in_a_log(filtered):
    """Issue 36 item 6: DeepSpeed's runner warns of a missing hostfile on every one-node `bash launch/pretrain.sh`,
    AutoTP of the vocabulary-sharded head the trainer always asks for; datasets' bars glue into one line in a log
    file. The same logger's other warnings still show."""
    import os

    filtered()
    deepspeed_logger = logging.getLogger("DeepSpeed")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # on the logger itself: whatever propagates
    deepspeed_logger.addHandler(handler)
    level, deepspeed_logger.level = deepspeed_logger.level, logging.WARNING
    disabled, deepspeed_logger.disabled = deepspeed_logger.disabled, False  # another test's logging config may
    try:
        deepspeed_logger.warning("Unable to find hostfile, will proceed with training with local resources only.")
        deepspeed_logger.warning("[Rank 0] AutoTP: vocab_parallel_lm_head supersedes the configured 'column' "
                                 "partitioning for 'lm_head'; the head stays vocabulary-sharded and its output is "
                                 "not gathered.")
        deepspeed_logger.warning("AutoTP: a real AutoTP warning")
    finally:
        deepspeed_logger.removeHandler(handler)
        deepspeed_logger.level, deepspeed_logger.disabled = level, disabled
    assert seen == ["AutoTP: a real AutoTP warning"]
    assert os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS") == "1"  # pytest's stderr is not a terminal
    assert "log_filter.install" in log_filter.RUNNER_WITH_FILTER and "deepspeed.launcher.runner" in \
        log_filter.RUNNER_WITH_FILTER


@pytest.mark.parametrize("body, code, stderr", [
    ("print('done')", 0, ""), ("sys.exit(3)", 3, ""), ("sys.exit(None)", 0, ""),
    ("sys.exit('the runner says no')", 1, "the runner says no\n")])
def test_the_runners_wrapper_exits_with_the_runners_status_and_its_output_flushed(body, code, stderr):
    """`run_and_leave` (what the supervisor's runner process ends with) gives the status the interpreter would,
    and nothing written before the exit is lost although the interpreter's teardown is skipped."""
    program = (f"import sys; from ntl_pretrain.runtime.log_filter import run_and_leave; sys.stdout.write('out ');"
               f"run_and_leave(lambda: exec({body!r}))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="0"))
    assert (done.returncode, done.stderr) == (code, stderr)
    assert done.stdout == ("out done\n" if body.startswith("print") else "out ")


def test_deepspeeds_autotuner_does_not_import_mlflow_and_everyone_else_still_can():
    """ntl_pretrain/core/deepspeed_imports.py: once an entry point skips it, DeepSpeed's autotuner does not import
    mlflow (1.5 s a process); the trainer's MLflow tracker imports it afterwards as usual."""
    program = ("import sys; from ntl_pretrain.core.deepspeed_imports import skip_autotuner_mlflow; "
               "skip_autotuner_mlflow(); import deepspeed; from deepspeed.autotuning import autotuner; "
               "assert not autotuner.has_mlflow and 'mlflow' not in sys.modules, 'mlflow imported'; "
               "import mlflow; print(mlflow.__name__)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu"))
    assert done.returncode == 0 and done.stdout.strip() == "mlflow", done.stderr[-2000:]


def test_importing_the_package_or_its_loss_changes_nothing_outside_it():
    """A user's own script (an HF Trainer with HFTrainerLoss) imports ntl_pretrain.loss: its import machinery and
    DeepSpeed stay as they were (issue 48 item 4); the processes a run starts skip the import themselves."""
    program = ("import sys; finders = list(sys.meta_path); import ntl_pretrain, ntl_pretrain.loss, "
               "ntl_pretrain.numbers; assert sys.meta_path == finders, sys.meta_path; import deepspeed; "
               "from deepspeed.autotuning import autotuner; print(autotuner.has_mlflow)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu"))
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    imports = "(?m)^import time:.*\\|\\s+{}$"  # `python -X importtime` lists each module it imports
    for entry_point in (["launch/pretrain.sh", "--dry-run", "--config", "configs/demo.yaml"],  # a rank, the dry run
                        ["-c", log_filter.RUNNER_WITH_FILTER, "--help"]):  # the supervisor's DeepSpeed runner
        started = subprocess.run([sys.executable, "-X", "importtime", *entry_point], capture_output=True, text=True,
                                 timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu"))
        assert re.search(imports.format("deepspeed"), started.stderr), started.stderr[-2000:]
        # a skipped import is listed too (tens of microseconds); a real one imports mlflow's own modules
        assert not re.search(imports.format(r"mlflow\.\w+"), started.stderr), entry_point
    for tool in ("evaluate.py", "export_hf.py", "reshard.py"):  # they import DeepSpeed only past their argument checks
        assert "\nskip_autotuner_mlflow()" in (REPO / "tools" / tool).read_text(), tool
