"""A real SLURM cluster on localhost for tests: one slurmctld and one slurmd per node (`slurmd -N NAME`, each on its
own port), started as root from a minimal slurm.conf in a temp dir, with no munge (auth/none). Every node is in the
default partition; the last two are also in a second one, where losing a node leaves fewer than a 2-node job."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")
SBIN = ("/usr/sbin", "/usr/local/sbin")
"""Where Debian puts the daemons: not on a non-root PATH."""
INSTALL = "apt-get install -y slurmctld slurmd slurm-client"


def missing_binaries() -> list[str]:
    """The SLURM commands that are not installed here."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return [name for name in BINARIES if shutil.which(name, path=path) is None]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class SlurmCluster:
    """A running cluster: its slurm.conf (SLURM_CONF for every client), its nodes and its one partition."""

    directory: Path
    conf: Path
    nodes: tuple[str, ...]
    partition: str
    pair: str = "pair"
    """The partition of the last two nodes."""

    def env(self) -> dict[str, str]:
        """The variables that point SLURM's clients at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def command(self, *args: str, check: bool = True) -> str:
        """Run a SLURM client command against this cluster; its stdout."""
        done = subprocess.run(
            list(args), env={**os.environ, **self.env()}, capture_output=True, text=True, timeout=60, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def idle_nodes(self) -> int:
        """How many nodes the controller sees idle."""
        out = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return sum(1 for line in out.splitlines() if line.split()[-1:] == ["idle"])

    def log(self, name: str = "slurmctld") -> str:
        """The end of a daemon's log (slurmctld, or slurmd-NODE), for a failing test's message."""
        path = self.directory / "log" / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        """Shut the controller and every slurmd down; those that linger are killed by their pid files, and the job
        steps they leave (slurmstepd and its tasks, which outlive slurmd) by their SLURM_CONF."""
        self.command("scontrol", "shutdown", check=False)
        pids = [self.directory / "slurmctld.pid", *(self.directory / f"slurmd-{n}.pid" for n in self.nodes)]
        deadline = time.monotonic() + 10
        for pid_file in pids:
            if not pid_file.exists():
                continue
            pid = int(pid_file.read_text().strip() or 0)
            while pid and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        reap(self.conf)


def _conf_of(pid: int) -> str | None:
    """The SLURM_CONF a process started with (slurmd's steps and their tasks inherit the test cluster's), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            fields = f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return None
    value = next((v for v in fields if v.startswith(b"SLURM_CONF=")), None)
    return value.split(b"=", 1)[1].decode(errors="replace") if value else None


def reap(conf: Path | None = None) -> list[int]:
    """SIGKILL the processes of a test cluster (slurmstepd, a job's tasks, a launcher) that outlived it: those
    started with SLURM_CONF `conf`, or, without one, with the slurm.conf of any test cluster whose slurmctld is gone
    (a session killed before its teardown). The pids killed."""
    mine = {os.getpid(), os.getppid()}
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        found = _conf_of(int(entry.name))
        if found is None or not found.endswith("/slurm.conf"):
            continue
        if conf is not None:
            if found != str(conf):
                continue
        else:
            # Only an orphan: a cluster whose directory is gone, or whose controller died. One that runs (another
            # session's) or is starting (no pid file yet) keeps its processes.
            pid_file = Path(found).parent / "slurmctld.pid"
            if Path(found).parent.exists() and not pid_file.exists():
                continue
            text = pid_file.read_text().strip() if pid_file.exists() else ""
            if text.isdigit() and _alive(int(text)):
                continue
        try:
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except ProcessLookupError:
            pass
    return killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A daemon that exited but was not reaped yet (its parent is this process) is gone too.
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def slurm_conf(directory: Path, nodes: tuple[str, ...], partition: str, hostname: str) -> str:
    """The smallest slurm.conf for several nodes on this host, tuned so that tests wait little."""
    ctld_port, slurmd_port, *node_ports = _free_ports(2 + len(nodes))
    node_lines = [
        # 2 CPUs: two tasks of a job (--tasks-per-node 2), or two jobs of one task, on a node.
        f"NodeName={name} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=1000 State=UNKNOWN"
        for name, port in zip(nodes, node_ports, strict=True)
    ]
    return "\n".join(
        [
            "ClusterName=lmstack-test",
            f"SlurmctldHost={hostname}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            # No munge daemon to run: the cluster trusts its one host.
            "AuthType=auth/none",
            "CredType=cred/none",
            # A requeued job waits cred_expire (120 s by default) before it may start again.
            "AuthInfo=cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={directory}/state",
            f"SlurmdSpoolDir={directory}/spool/%n",
            f"SlurmctldPidFile={directory}/slurmctld.pid",
            f"SlurmdPidFile={directory}/slurmd-%n.pid",
            f"SlurmctldLogFile={directory}/log/slurmctld.log",
            f"SlurmdLogFile={directory}/log/slurmd-%n.log",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # A pending job whose begin time has passed starts at the next pass of the scheduler (60 s by default).
            "SchedulerParameters=sched_interval=1",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            # A node that answers comes back by itself, but one set DOWN by `scontrol` stays down (a lost node).
            "ReturnToService=1",
            "KillWait=10",
            "MailProg=/bin/true",
            *node_lines,
            f"PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName=pair Nodes={','.join(nodes[-2:])} MaxTime=INFINITE State=UP",
            "",
        ]
    )


def start_cluster(
    directory: Path, nodes: tuple[str, ...] = ("n1", "n2", "n3", "n4"), partition: str = "debug"
) -> SlurmCluster:
    """Write slurm.conf, start slurmctld and one slurmd per node, and wait until every node is idle; first the
    leftovers of a test cluster whose session was killed before its teardown."""
    reap()
    for sub in ("state", "log", *(f"spool/{n}" for n in nodes)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    conf = directory / "slurm.conf"
    conf.write_text(slurm_conf(directory, nodes, partition, socket.gethostname()), encoding="utf-8")
    cluster = SlurmCluster(directory, conf, nodes, partition)
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    env = {**os.environ, "PATH": path, **cluster.env()}
    # Both daemons fork into the background once they are up; -c: a clean state, whatever a crashed run left.
    slurmctld, slurmd = shutil.which("slurmctld", path=path), shutil.which("slurmd", path=path)
    subprocess.run([slurmctld, "-c", "-f", str(conf)], env=env, check=True, timeout=60)
    for node in nodes:
        subprocess.run([slurmd, "-f", str(conf), "-N", node], env=env, check=True, timeout=60)
    deadline = time.monotonic() + 60
    while cluster.idle_nodes() < len(nodes):
        if time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(f"the SLURM nodes did not come up within 60 s:\n{cluster.log()}")
        time.sleep(0.1)
    return cluster
