"""What started this trainer process, checked before anything is built.

- `python launch/pretrain.sh ...` with no launcher: a world of one (as the Hugging Face Trainer runs), instead
  of DeepSpeed's MPI discovery failing on a missing `mpi4py`.
- `accelerate launch`: refused in one line (DeepSpeed's own launcher, torchrun or `bash launch/pretrain.sh`
  start the ranks; accelerate's settings would be ignored).
- A rendezvous port that another process holds: refused on the rank that would listen on it, at once, instead
  of a long EADDRINUSE traceback after the store's retries.
"""

from __future__ import annotations

import os
import socket

# Set by any launcher that starts ranks itself: DeepSpeed's launch.py, torchrun, srun (the sbatch script),
# mpirun (DeepSpeed's MPI discovery then finds the ranks), AzureML / SageMaker (DeepSpeed discovers those too).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                      "MV2_COMM_WORLD_SIZE", "AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV")
# `accelerate launch` sets these for every process it starts (accelerate/utils/launch.py), one process or many.
ACCELERATE_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")
LAUNCH_COMMANDS = ("`deepspeed [--num_gpus N] launch/pretrain.sh ...`, `torchrun --nproc_per_node N launch/pretrain.sh "
                   "...` or `bash launch/pretrain.sh ...`")


class LauncherError(ValueError):
    """The process was started in a way the trainer cannot run under (exit 2, one line)."""


class PortTakenError(LauncherError):
    """The rendezvous port is held by another process on the rank that must listen on it (exit 2, one line; under
    `bash launch/pretrain.sh` with no port named, the supervisor starts the job again on another port)."""


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a listening socket could be bound to `port` now (SO_REUSEADDR as torch's store sets it, so a
    port left in TIME_WAIT by an earlier run counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on every address now (the kernel's pick), for a rendezvous or a service."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def busy_port_message(port: int, how_to_choose: str) -> str:
    """The one line for a rendezvous port that another process holds."""
    return (f"the rendezvous port {port} is in use on this machine (another job? `ss -ltnp 'sport = :{port}'` "
            f"names it): {how_to_choose} (e.g. {free_port()}, free now)")


def check_accelerate_launch() -> None:
    """Refuse `accelerate launch`."""
    if any(name in os.environ for name in ACCELERATE_VARIABLES):
        raise LauncherError(f"`accelerate launch` is not supported (its settings would be ignored; the DeepSpeed "
                            f"config comes from the run's YAML): start the trainer with {LAUNCH_COMMANDS}")


def has_launcher() -> bool:
    """Whether a launcher set this process's rank (or MPI/a cloud runtime will tell DeepSpeed)."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def use_world_of_one() -> bool:
    """Without a launcher, describe a world of one process to torch.distributed (rank 0 of 1 on a free
    loopback port); return whether it did. A launcher's environment is left as it is."""
    if has_launcher():
        return False
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    return True


def check_rendezvous_port() -> None:
    """On the process that will listen on MASTER_PORT (global rank 0, unless torchrun's agent holds the store),
    refuse a port another process holds, before the rendezvous retries on it."""
    port = os.environ.get("MASTER_PORT", "")
    if os.environ.get("RANK") != "0" or not port.isdigit():
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return  # torchrun's agent listens on the port itself and hands its store to the ranks
    if not port_is_free(int(port)):
        raise PortTakenError(busy_port_message(int(port), "choose another with `--master_port N` (DeepSpeed's "
                                              "launcher, torchrun), NTL_DEEPSPEED_ARGS=\"--master_port N\" "
                                              "(bash launch/pretrain.sh) or MASTER_PORT=N"))


PORT_TAKEN_EVENT = "port_taken"  # reported to the supervisor, which then starts again on another port


def port_taken_message(error: BaseException) -> str | None:
    """One line for a rendezvous whose port another process took before this rank (the one that listens) bound it:
    torch's store fails with EADDRINUSE. None for any other error."""
    texts = [str(error), str(error.__cause__ or ""), str(error.__context__ or "")]
    if not any("EADDRINUSE" in text or "address already in use" in text.lower() for text in texts):
        return None
    port = os.environ.get("MASTER_PORT", "?")
    return (f"the rendezvous port {port} was taken by another process before this rank (global rank "
            f"{os.environ.get('RANK', '0')}, which listens on it) could bind it; nothing ran and nothing was written: "
            f"start again (bash launch/pretrain.sh picks another free port itself when you name none), or name a "
            f"free one with `--master_port N` / NTL_DEEPSPEED_ARGS=\"--master_port N\" (e.g. {free_port()}, free now)")
