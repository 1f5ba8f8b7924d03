"""A throwaway single-node Slurm (munged, slurmctld, slurmd on 127.0.0.1) for the tests.

Everything lives in a fresh temporary folder with fresh ports and a unique cluster name, and the
daemons run in the foreground as children of the test, so a daemon left over from an earlier
run can neither be reused nor get in the way. Needs root and Debian's `slurm-wlm` and `munge`.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field

TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo")
INSTALL_HINT = "install them with `apt-get install slurm-wlm munge` (as root)"
CPUS = 2
# `sbatch --wait` polls the job every 2 s, 8 s, then 32 s unless completed jobs may be purged
# sooner (it keeps its sleep under half of MinJobAge, Slurm's sbatch.c): with the default 300 s a
# 12 s job is seen done after 42 s. 4 s keeps it polling every 2 s.
MIN_JOB_AGE = 4
# A requeued job may start again once its first run's credential has expired (slurm.conf(5),
# AuthInfo's cred_expire, 120 s by default); starting it sooner fails with "Job credential
# revoked". 30 s is still far longer than any step takes to launch here.
CRED_EXPIRE = 30

SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
TmpFS={root}/tmp
FirstJobId={first_job}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge={min_job_age}
MpiDefault=none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (bound once by the kernel's choice, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except FileNotFoundError:
        return "(no log)"


@dataclass
class SlurmCluster:
    """A running single-node cluster: `env` points Slurm's commands at it."""

    root: str
    name: str  # ClusterName, unique per cluster
    env: dict
    daemons: dict = field(default_factory=dict)  # name -> Popen

    def run(self, command: list[str], timeout: float = 300, **kwargs):
        """Run a Slurm command (srun, sbatch, ...) against this cluster; never hangs forever."""
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}{suffix} (tail) ---\n{_tail(os.path.join(self.root, name + suffix))}"
            for name in ("munged", "slurmctld", "slurmd")
            for suffix in (".log", ".out")
        )

    def wait_until_idle(self, timeout: float = 60) -> None:
        """Wait until the node accepts jobs (state idle)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            out = self.run(["sinfo", "-h", "-N", "-o", "%t"], timeout=30)
            state = out.stdout.strip()
            if out.returncode == 0 and state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node did not become idle (state {state!r})\n{self.logs()}")

    def stop(self) -> None:
        """Shut the daemons down (politely, then by their pids) and remove the folder."""
        try:
            if "slurmctld" in self.daemons:
                self.run(["scontrol", "shutdown"], timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.get(name)
            if proc is None:
                continue
            if name == "munged":  # Slurm's shutdown leaves munged running
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _start(cluster: SlurmCluster, name: str, command: list[str]) -> None:
    with open(os.path.join(cluster.root, f"{name}.out"), "w") as log:
        cluster.daemons[name] = subprocess.Popen(
            command, env=cluster.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_for(path: str, cluster: SlurmCluster, name: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if cluster.daemons[name].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start\n{cluster.logs()}")
        time.sleep(0.1)


def start_cluster(extra_env: dict | None = None) -> SlurmCluster:
    """Start munged, slurmctld and slurmd; stop everything again if any step fails."""
    root = tempfile.mkdtemp(prefix="hf-slurm-")
    os.chmod(root, 0o755)  # munged refuses sockets in folders others may write to
    for sub in ("munge", "state", "spool", "tmp"):
        os.makedirs(os.path.join(root, sub), mode=0o755)
    munge_socket = os.path.join(root, "munge", "munge.socket.2")
    ctld_port, slurmd_port = _free_ports(2)
    name = f"hf{uuid.uuid4().hex[:8]}"
    conf = os.path.join(root, "slurm.conf")
    with open(conf, "w") as f:
        f.write(
            SLURM_CONF.format(
                cluster=name,
                ctld_port=ctld_port,
                slurmd_port=slurmd_port,
                munge_socket=munge_socket,
                root=root,
                cpus=CPUS,
                min_job_age=MIN_JOB_AGE,
                cred_expire=CRED_EXPIRE,
                # job ids name PMIx's per-step folders: never reuse an earlier cluster's
                first_job=random.randrange(1000, 1_000_000),
            )
        )
    env = {**os.environ, **(extra_env or {}), "SLURM_CONF": conf}
    for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
        if key != "SLURM_CONF":  # a test run inside a Slurm job must not leak that job's ids
            del env[key]
    cluster = SlurmCluster(root, name, env)
    try:
        key = os.path.join(root, "munge", "munge.key")
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        _start(
            cluster,
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={root}/munge/munged.pid",
                f"--log-file={root}/munged.log",
                f"--seed-file={root}/munge/munged.seed",
            ],
        )
        _wait_for(munge_socket, cluster, "munged")
        _start(cluster, "slurmctld", ["slurmctld", "-D", "-i"])
        _wait_for(os.path.join(root, "slurmctld.pid"), cluster, "slurmctld")
        _start(cluster, "slurmd", ["slurmd", "-D", "-N", "localhost"])
        cluster.wait_until_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster
