"""Run by every Python process the tests start (tests/conftest.py puts this folder on PYTHONPATH): it
installs the project's skip of DeepSpeed's autotuner `import mlflow` (ntl_pretrain/core/deepspeed_imports.py) before
anything imports DeepSpeed, in the processes the project does not start itself too: DeepSpeed's own `deepspeed`
runner and its launch.py (1.5 s each of every launch with mlflow installed; the ranks and the supervisor's runner
install it themselves). It changes how fast a test starts, nothing a test checks."""

try:
    from ntl_pretrain.core.deepspeed_imports import skip_autotuner_mlflow
except ImportError:  # an interpreter without this checkout on its path (a test's fresh virtualenv)
    pass
else:
    skip_autotuner_mlflow()
