"""scripts/slurm/pipeline.sbatch on a SLURM cluster of one host: munged, slurmctld and three slurmd (logical nodes
n1..n3, each with an address of its own on the loopback network, 127.0.0.2-4) started here from a temporary directory.
The job runs the learner on n1 and n2 (torchrun, a c10d rendezvous, one gloo rank each) and a generator on n3, which
reads the hub's address from RUN_DIR/hub.json and authenticates with its own CURVE key; the job ends with the learner,
and fails when the learner fails.

Skipped, with the reason, where SLURM is not installed (scripts/install-cpu.sh installs it as root) or its daemons
cannot start."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq.auth

from pipeline.metrics import read_jsonl
from pipeline.netutil import reserved_port
from tests.conftest import REPO, Proc

pytestmark = pytest.mark.integration
SCRIPT = REPO / "scripts" / "slurm" / "pipeline.sbatch"
NODES = {"n1": "127.0.0.2", "n2": "127.0.0.3", "n3": "127.0.0.4"}
STEPS, BATCH = 4, 8
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

SLURM_CONF = """\
ClusterName=pipeline-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
# no cgroups: processes are tracked through /proc, tasks are not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# each logical node claims the host's cores
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
KillWait=10
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=15 State=UP
"""


def _slurm_env(conf: Path) -> dict:
    """This environment for SLURM's commands, without the variables of a job this test might itself run in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    return {**env, "SLURM_CONF": str(conf), "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"}


def _idle(env: dict) -> bool:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=30)
    states = dict(line.split() for line in out.stdout.splitlines())
    return out.returncode == 0 and all(states.get(n) == "idle" for n in NODES)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment for sbatch and the other commands, once the three nodes are idle."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"SLURM is not installed (no {', '.join(missing)}): apt-get install slurmctld slurmd "
                    "slurm-client munge, as scripts/install-cpu.sh does as root")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs each job's tasks as the job's user: it needs root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
        (d / sub).mkdir(parents=True)
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    nodes = "\n".join(f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr={addr} Port={reserved_port()} CPUs=2 "
                      "State=UNKNOWN" for n, addr in NODES.items())
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), ctld_port=reserved_port(), d=d, nodes=nodes))
    env = _slurm_env(conf)
    daemons = [Proc(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={d}/munge/munge.socket",
                     f"--pid-file={d}/munge/munged.pid", f"--seed-file={d}/munge/seed",
                     f"--log-file={d}/log/munged.log"], d / "log" / "munged.out", env)]
    try:
        deadline = time.monotonic() + 10
        while not (d / "munge" / "munge.socket").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        daemons.append(Proc(["slurmctld", "-D", "-f", str(conf)], d / "log" / "slurmctld.out", env))
        daemons += [Proc(["slurmd", "-D", "-f", str(conf), "-N", n], d / "log" / f"slurmd-{n}.out", env) for n in NODES]
        deadline = time.monotonic() + 60
        while not _idle(env):
            if time.monotonic() > deadline or any(p.proc.poll() is not None for p in daemons):
                logs = "\n".join(f"{p.name}: {p.proc.poll()}\n{p.tail(15)}" for p in daemons)
                pytest.skip(f"SLURM's daemons did not bring up three idle nodes within 60 s:\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        for p in reversed(daemons):  # slurmd first, munged last
            p.stop(grace=15)


def _job_state(job: str, env: dict) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=30)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState", "")


def _job_processes(job: str) -> list[str]:
    """Processes of the job still running: their environment names it."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"SLURM_JOB_ID={job}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                left.append(f"{entry.name} {cmdline}")
        except OSError:
            continue
    return left


def _run_job(cluster: dict, tmp_path: Path, model_cache: Path, args: str) -> tuple[str, str]:
    """Submit the script for a 2-node learner and 1 generator node, wait for the job to end; (its state, the logs).
    Every process of the job must be gone by then."""
    out = tmp_path / "job.out"
    env = {**cluster, "PIPELINE_CACHE": str(model_cache), "CONFIG": "configs/demo.yaml",
           "RUN_DIR": str(tmp_path / "run"), "LEARNER_NODES": "2", "RDZV_PORT": str(reserved_port()),
           "PIPELINE_ARGS": args}
    sub = subprocess.run(["sbatch", "--parsable", "--nodes=3", f"--output={out}", f"--chdir={REPO}", str(SCRIPT)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 480
        while (state := _job_state(job, cluster)) not in ENDED and time.monotonic() < deadline:
            time.sleep(1)
        deadline = time.monotonic() + 30  # the job's steps end with it; their processes, a moment later
        while (left := _job_processes(job)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, left
    finally:
        subprocess.run(["scancel", job], env=cluster, capture_output=True, timeout=30)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in [out, *sorted((tmp_path / "run" / "logs").glob("*.log"))] if p.exists())
    return state, logs


def test_the_sbatch_script_trains_with_learner_nodes_and_a_generator_node(cluster, tmp_path, model_cache):
    run_dir = tmp_path / "run"
    state, logs = _run_job(cluster, tmp_path, model_cache, f"--set trainer.total_steps={STEPS} "
                           f"--set trainer.batch_size={BATCH} --set trainer.checkpoint_every=0")
    assert state == "COMPLETED", logs
    assert "pipeline.sbatch: the learner exited with 0" in logs

    # the learner: one rank on each learner node; rank 0's hub bound its node's address, given by SLURM, with keys
    learner_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("learner-*.log"))
    assert "learner rank 0 of 2" in learner_logs and "learner rank 1 of 2" in learner_logs
    # each torchrun agent's own files went to the run directory (by default a torchelastic_* folder in the temp
    # folder of each node, left there)
    assert len(list((run_dir / "logs" / "torchrun").iterdir())) == 2
    hub = json.loads((run_dir / "hub.json").read_text())
    host, port = hub["address"].removeprefix("tcp://").rsplit(":", 1)
    assert host in (NODES["n1"], NODES["n2"]) and int(port) > 0
    assert f"hub listening on {hub['address']} (CURVE: listed keys only)" in learner_logs
    # the generator on n3 found the hub through hub.json and registered with its own key, gen0
    public, _ = zmq.auth.load_certificate(run_dir / "keys" / "generators" / "gen0.key")
    registered = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register"]
    assert registered and {e["key"] for e in registered} == {public.decode()}
    # every step, each group trained once
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    trained = [(t[0], t[1]) for r in records for t in r["trained"]]
    assert len(trained) == len(set(trained)) == STEPS * BATCH
    assert (run_dir / "final" / "config.json").exists()


def test_a_learner_that_fails_fails_the_job(cluster, tmp_path, model_cache):
    """Its ranks exit 2 on a config error, before any hub: the job fails at once, no generator started."""
    state, logs = _run_job(cluster, tmp_path, model_cache, "--set trainer.max_stalness=1")
    assert state == "FAILED", logs
    assert "trainer.max_stalness: unknown field" in logs and "pipeline.sbatch: the learner exited with 1" in logs
    assert not list((tmp_path / "run" / "logs").glob("generator-*.log"))
