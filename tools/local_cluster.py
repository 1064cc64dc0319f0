"""A two-node ssh "cluster" and a one-host Slurm on this machine, to try the multi-node launch paths.

Recipe (as root; nothing in /etc is changed, everything lives under DIR; loopback addresses only):

  python tools/local_cluster.py ssh DIR      # its own sshd, nodes node1=127.0.0.1 and node2=127.0.0.2
  python tools/local_cluster.py slurm DIR    # munged + slurmctld + slurmd with this host's CPUs

Each prints the environment and the launch command to copy into another shell, then keeps the services
up until Ctrl-C. The tests (tests/test_multinode_ssh.py, tests/test_slurm.py) use the same classes.

ssh: DeepSpeed's runner calls plain `ssh` (its passwordless-ssh check and `hostname -I`) and pdsh calls
`ssh` too, both reading ~/.ssh/config of the user in the password database. To use a config of our own
without touching ~/.ssh, DIR/bin/ssh runs `ssh -F DIR/ssh_config "$@"` and DIR/bin comes first in PATH.
On a real cluster none of this is needed: the hosts resolve, and ~/.ssh holds the key.
"""

from __future__ import annotations

import argparse
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from ntl_pretrain.runtime.supervisor import free_port  # noqa: E402

# binary -> the Debian package that provides it
SSH_PACKAGES = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh"}
SLURM_PACKAGES = {"munged": "munge", "mungekey": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
                  "sbatch": "slurm-client", "scontrol": "slurm-client", "scancel": "slurm-client"}
SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
_APT_UPDATED: list[bool] = []


def find_binary(name: str) -> str | None:
    """The absolute path of `name` in PATH or the sbin folders (daemons must be started by absolute path)."""
    return shutil.which(name) or next((str(Path(d) / name) for d in SBIN_DIRS if (Path(d) / name).is_file()), None)


def require(binaries: dict[str, str]) -> dict[str, str]:
    """Absolute paths of the binaries; installs the packages of missing ones with apt-get (as root).

    Raises RuntimeError naming the package when it cannot be had.
    """
    missing = sorted({package for name, package in binaries.items() if find_binary(name) is None})
    if missing:
        if os.geteuid() != 0:
            raise RuntimeError(f"packages {' '.join(missing)} are missing and installing them needs root: "
                               f"run `apt-get install -y {' '.join(missing)}`")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        log = []
        commands = [["apt-get", "install", "-y", "--no-install-recommends", *missing]]
        if not _APT_UPDATED:  # once per process
            commands.insert(0, ["apt-get", "update"])
            _APT_UPDATED.append(True)
        for command in commands:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            log.append(done.stdout[-2000:] + done.stderr[-2000:])
        still = sorted({package for name, package in binaries.items() if find_binary(name) is None})
        if still:
            raise RuntimeError(f"could not install the Debian packages {' '.join(still)} with apt-get:\n" + "\n".join(log))
    return {name: find_binary(name) for name in binaries}


class Daemon:
    """A service started in the foreground in its own session, stopped with its whole process group."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log = name, log
        with open(log, "ab") as handle:
            self.process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True)

    def check(self) -> None:
        """Raise with the log's tail if the daemon has exited."""
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue


def wait_until(what: str, predicate, timeout: float, daemons: list[Daemon]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for daemon in daemons:
            daemon.check()
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


class Services:
    """Daemons stopped in reverse order by stop() (also at interpreter exit)."""

    def __init__(self) -> None:
        self.daemons: list[Daemon] = []

    def start(self, name: str, command: list[str], log: Path, env: dict[str, str] | None = None) -> Daemon:
        daemon = Daemon(name, command, log, env)
        self.daemons.append(daemon)
        return daemon

    def stop(self) -> None:
        while self.daemons:
            self.daemons.pop().stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SshCluster(Services):
    """sshd on 127.0.0.1 and 127.0.0.2 (one port), host names node1 and node2, a hostfile with `slots` each."""

    HOSTS = {"node1": "127.0.0.1", "node2": "127.0.0.2"}

    def __init__(self, root: Path, port: int, slots: int = 1) -> None:
        super().__init__()
        self.root, self.port = Path(root), port
        self.root.mkdir(parents=True, exist_ok=True)
        paths = require(SSH_PACKAGES)
        for key in ("host_key", "user_key"):
            if not (self.root / key).exists():
                subprocess.run([paths["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-C", key, "-f",
                                str(self.root / key)], check=True)
        shutil.copy(self.root / "user_key.pub", self.root / "authorized_keys")
        host_key = (self.root / "host_key.pub").read_text().split()[:2]
        known = ",".join(f"[{name}]:{port},[{addr}]:{port}" for name, addr in self.HOSTS.items())
        (self.root / "known_hosts").write_text(f"{known} {' '.join(host_key)}\n")
        (self.root / "sshd_config").write_text("\n".join([
            f"Port {port}", *(f"ListenAddress {addr}" for addr in self.HOSTS.values()),
            f"HostKey {self.root / 'host_key'}", f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            f"PidFile {self.root / 'sshd.pid'}", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no", "X11Forwarding no",
            "PrintMotd no", "LogLevel ERROR", ""]))
        (self.root / "ssh_config").write_text("\n".join([
            *(f"Host {name}\n    HostName {addr}" for name, addr in self.HOSTS.items()),
            "Host *", f"    Port {port}", f"    User {getpass.getuser()}", f"    IdentityFile {self.root / 'user_key'}",
            "    IdentitiesOnly yes", f"    UserKnownHostsFile {self.root / 'known_hosts'}",
            "    StrictHostKeyChecking yes", "    BatchMode yes", "    LogLevel ERROR", ""]))
        bin_dir = self.root / "bin"
        bin_dir.mkdir(exist_ok=True)
        wrapper = bin_dir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {paths["ssh"]} -F {self.root / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        self.hostfile = self.root / "hostfile"
        self.hostfile.write_text("".join(f"{name} slots={slots}\n" for name in self.HOSTS))
        # sshd refuses to start without its privilege-separation folder (a runtime folder, not configuration)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.sshd = self.start("sshd", [paths["sshd"], "-D", "-e", "-f", str(self.root / "sshd_config")],
                               self.root / "sshd.log")
        wait_until("sshd to accept ssh logins", lambda: all(self._login_works(h) for h in self.HOSTS), 30, [self.sshd])

    def _login_works(self, host: str) -> bool:
        done = subprocess.run([str(self.root / "bin" / "ssh"), host, "true"], capture_output=True, timeout=30)
        return done.returncode == 0

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The launcher's environment: our ssh first in PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env


class SlurmCluster(Services):
    """munged, slurmctld and slurmd for one node (this host, at 127.0.0.1) with its CPU count; state, spool
    and the munge key under `root`. Client commands need `env()` (SLURM_CONF)."""

    def __init__(self, root: Path, ctld_port: int, slurmd_port: int, cpus: int | None = None) -> None:
        super().__init__()
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        paths = require(SLURM_PACKAGES)
        self.paths = paths
        self.node = socket.gethostname().split(".")[0]
        cpus = cpus or os.cpu_count() or 1
        munge = self.root / "munge"
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        if not key.exists():
            subprocess.run([paths["mungekey"], "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o600)
        self.socket = munge / "munge.socket"
        self.start("munged", [paths["munged"], "--foreground", "--force", f"--key-file={key}", f"--socket={self.socket}",
                              f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                              f"--seed-file={munge / 'munged.seed'}"], self.root / "log" / "munged.out")
        wait_until("munged's socket", self.socket.exists, 30, self.daemons)
        user = getpass.getuser()
        self.conf = self.root / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=local", f"SlurmctldHost={self.node}(127.0.0.1)", f"SlurmUser={user}", f"SlurmdUser={user}",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}", "AuthType=auth/munge",
            "CredType=cred/munge", f"AuthInfo=socket={self.socket},cred_expire=15", f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}", f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}", f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_min_interval=100000",
            "ReturnToService=2", "SlurmdTimeout=60", "KillWait=30", "InactiveLimit=0", "MinJobAge=600",
            "JobRequeue=1", "SwitchType=switch/none", "LaunchParameters=use_interactive_step",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO", ""]))
        env = self.env()
        self.start("slurmctld", [paths["slurmctld"], "-D", "-i", "-f", str(self.conf)], self.root / "log" / "slurmctld.out",
                   env)
        self.start("slurmd", [paths["slurmd"], "-D", "-f", str(self.conf), "-N", self.node], self.root / "log" / "slurmd.out",
                   env)
        wait_until("the Slurm node to be idle", self._node_idle, 60, self.daemons)

    def _node_idle(self) -> bool:
        done = subprocess.run([self.paths["scontrol"], "show", "node", self.node], env=self.env(), capture_output=True,
                              text=True, timeout=30)
        return done.returncode == 0 and "State=IDLE" in done.stdout

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["ssh", "slurm"])
    parser.add_argument("dir", type=Path, help="folder for keys, configuration, state and logs")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    if args.kind == "ssh":
        cluster = SshCluster(args.dir.resolve(), free_port())
        env_file = args.dir.resolve() / "deepspeed_env"
        env_file.write_text(f"DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\nPYTHONPATH={repo}\n")
        print(f"export PATH={cluster.root / 'bin'}:$PATH DS_ENV_FILE={env_file}\n"
              f"deepspeed --hostfile {cluster.hostfile} --master_addr 127.0.0.1 --master_port {free_port()} "
              f"launch/pretrain.sh --config configs/demo.yaml parallel.tp_size=2")
    else:
        cluster = SlurmCluster(args.dir.resolve(), free_port(), free_port())
        print(f"export SLURM_CONF={cluster.conf}\n"
              f"sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 "
              f"launch/slurm_pretrain.sbatch configs/demo.yaml")
    sys.stdout.flush()
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
