"""A real Slurm on this host for the tests: munged, slurmctld and two slurmd (``slurmd -N n1`` and ``-N n2``, both
on this host with their own ports) from the Debian packages ``slurm-wlm`` and ``munge``, each run in the
foreground (``-D``/``-F``) as a child process, with a generated ``slurm.conf`` and munge key in a temp dir
(no systemd, no cgroups: ``proctrack/linuxproc``, ``task/none``). Clients find it through ``SLURM_CONF``.
:func:`start` returns once the nodes are idle; :meth:`SlurmCluster.stop` cancels what is left and stops them."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from crosstrain.collective import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
NODES = ("n1", "n2")
#: a requeued job waits cred_expire + 1 s before it may start again (Slurm's default: 120 s)
CRED_EXPIRE_S = 5
#: CPUs each node declares (``SlurmdParameters=config_overrides`` lets it exceed the host's): two jobs of 2 tasks
#: run side by side on one node
CPUS_PER_NODE = 4

_CONF = """\
ClusterName=crosstrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket,cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=30
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{d1_port},{d2_port}] CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> list[str]:
    """The binaries this host lacks (empty: a Slurm can be started)."""
    return [b for b in BINARIES if shutil.which(b) is None]


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]  # the caller's environment plus SLURM_CONF
    nodes: list[str] = field(default_factory=list)  # the nodes that came up idle
    procs: list[subprocess.Popen] = field(default_factory=list)

    ports_given: set[int] = field(default_factory=set)

    def job_port(self) -> int:
        """A free rendezvous port for one job, outside the kernel's ephemeral range and new in this session. The
        port is chosen at submit and bound seconds later when the job starts; one from the ephemeral range (what
        ``free_port`` gives) can meanwhile be taken by any outgoing connection or ``bind(0)`` on the host, such
        as the gloo pairs of the runs beside the job."""
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        candidates = [port for port in range(10000, 32768) if not low <= port <= high and port not in self.ports_given]
        for port in random.sample(candidates, min(50, len(candidates))):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
            self.ports_given.add(port)
            return port
        raise AssertionError("no free port in 10000..32767 outside ip_local_port_range")

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job_id: str, states: tuple[str, ...], timeout: float = 240, restarts: int = 0) -> dict[str, str]:
        """Poll until the job is in one of ``states`` after ``restarts`` requeues; its fields. A job that ends
        otherwise fails the wait."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states and int(info.get("Restarts", "0")) >= restarts:
                return info
            if info.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(0.2)
        out = Path(info.get("StdOut", ""))
        job_log = out.read_text()[-3000:] if out.is_file() else f"(no job log at {out})"
        raise AssertionError(f"job {job_id} is {info.get('JobState')}, not {states}; its log ends:\n{job_log}\n"
                             f"--- scontrol show job\n{info}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-2000:] for p in sorted((self.root / "log").glob("*.log")))

    def stop(self) -> None:
        """Cancel every job left, wait for their tasks to end, then stop the daemons (TERM, then KILL)."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                time.sleep(0.5)
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start(root: Path, env: dict[str, str], timeout: float = 60) -> SlurmCluster:
    """Start munged, slurmctld and the node daemons under ``root``; returns when the nodes are idle (those that
    never came up are left out of ``nodes``; none: AssertionError with the daemons' logs)."""
    for sub in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o755)  # munged wants its socket folder reachable by every client
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(_CONF.format(host=socket.gethostname().split(".")[0], root=root, ctld_port=free_port(),
                                 d1_port=free_port(), d2_port=free_port(), cpus=CPUS_PER_NODE,
                                 cred_expire=CRED_EXPIRE_S))
    cluster = SlurmCluster(root, {**env, "SLURM_CONF": str(conf)})
    m = root / "munge"

    def spawn(*cmd: str, log: str) -> None:
        out = open(root / "log" / f"{log}.out", "w")  # noqa: SIM115  (the daemon writes it until stop())
        cluster.procs.append(subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=cluster.env,
                                              start_new_session=True))

    try:
        spawn("munged", "-F", "--force", f"--key-file={key}", f"--socket={m}/socket", f"--pid-file={m}/pid",
              f"--seed-file={m}/seed", f"--log-file={m}/log", log="munged")
        _until(lambda: (m / "socket").exists(), timeout, "munged did not create its socket")
        spawn("slurmctld", "-D", "-f", str(conf), log="slurmctld")
        _until(lambda: cluster.run("scontrol", "ping", check=False).stdout.count("UP") > 0, timeout,
               "slurmctld did not answer")
        for node in NODES:
            spawn("slurmd", "-D", "-f", str(conf), "-N", node, log=f"slurmd-{node}")

        def idle() -> bool:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
            cluster.nodes = sorted(n for n, state in (line.split() for line in out if line.strip())
                                   if state == "idle")
            return len(cluster.nodes) == len(NODES)

        try:
            _until(idle, timeout, "")
        except AssertionError:
            if not cluster.nodes:
                raise AssertionError(f"no Slurm node came up idle:\n{cluster.logs()}") from None
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _until(ready, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise AssertionError(message)
