"""bench/timeline.py's summary of a profiled run: a run of two learner ranks counts each step once (both ranks record
their steps on a "learner" track; counting both doubled the two-GPU run's steps/min, 19.3 for 10.1)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import timeline


def _process(pid: int, name: str, tracks: list[str]) -> list[dict]:
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}]
    return meta + [{"name": "thread_name", "ph": "M", "pid": pid, "tid": i + 1, "args": {"name": t}}
                   for i, t in enumerate(tracks)]


def _steps(pid: int, tid: int, n: int, period_us: int, offset_us: int = 0) -> list[dict]:
    out = []
    for step in range(n):
        ts = offset_us + step * period_us
        out += [{"name": "step", "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": period_us, "args": {"step": step}},
                {"name": "wait", "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": period_us // 4, "args": {}},
                {"name": "train", "ph": "X", "pid": pid, "tid": tid, "ts": ts + period_us // 4,
                 "dur": 3 * period_us // 4, "args": {}}]
    return out


def test_a_step_of_two_learner_ranks_counts_once(tmp_path: Path) -> None:
    period = 6_000_000  # a step every 6 s: 10 steps/min
    events = (_process(10, "learner-rank0", ["startup", "hub", "learner"]) + _steps(10, 3, 12, period)
              + _process(11, "learner-rank1", ["startup", "learner"]) + _steps(11, 2, 12, period, offset_us=1000))
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "metrics.jsonl").write_text("")

    learner = timeline.summary(tmp_path, skip=2)["learner"]

    assert learner["steps"] == 12 and learner["steady_steps"] == 10
    assert abs(learner["steps_per_min"] - 10.0) < 0.01
    assert learner["median_wait_s"] == 1.5 and abs(learner["wait_share"] - 0.25) < 1e-9


def test_a_single_rank_run_is_summarised_as_before(tmp_path: Path) -> None:
    events = _process(10, "learner-rank0", ["startup", "hub", "learner"]) + _steps(10, 3, 12, 3_000_000)
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "metrics.jsonl").write_text("")

    learner = timeline.summary(tmp_path, skip=2)["learner"]

    assert learner["steps"] == 12 and abs(learner["steps_per_min"] - 20.0) < 0.01


def test_the_last_steps_trained_after_generation_ended_are_not_the_rate(tmp_path: Path) -> None:
    """A run's last k steps train batches generated ahead, with nothing generating beside them: a colocated GPU-bound
    run trained them in 3 s against 5 s, and its 12-step rate counted two (13.2 steps/min for 12.1)."""
    events = _process(10, "learner-rank0", ["startup", "hub", "learner"]) + _steps(10, 3, 10, 6_000_000)
    for step, ts in ((10, 60_000_000), (11, 63_000_000)):  # 3 s each, after the engine's last group
        events += [{"name": "step", "ph": "X", "pid": 10, "tid": 3, "ts": ts, "dur": 3_000_000, "args": {"step": step}},
                   {"name": "train", "ph": "X", "pid": 10, "tid": 3, "ts": ts, "dur": 3_000_000, "args": {}}]
    events += _process(20, "generator", ["g0"]) + [
        {"name": "generate", "ph": "X", "pid": 20, "tid": 1, "ts": t, "dur": 5_000_000, "args": {"tokens": 100}}
        for t in range(0, 60_000_000, 5_000_000)]  # the last ends at 60 s, as step 9 does
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "metrics.jsonl").write_text("")

    learner = timeline.summary(tmp_path, skip=2)["learner"]

    assert learner["steady_steps"] == 8 and learner["tail_steps"] == 2
    assert abs(learner["steps_per_min"] - 10.0) < 0.01  # steps 2-9, 6 s each (with the tail: 12.5)


def test_the_start_is_listed_phase_by_phase_from_launch(tmp_path: Path) -> None:
    """The quick-start figure (issue 52 item 4) comes apart into the learner's and the engine's phases."""
    s = 1_000_000
    launched = 1000.0
    t0 = int(launched * s)

    def span(pid: int, tid: int, name: str, at: float, dur: float) -> dict:
        return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": t0 + int(at * s), "dur": int(dur * s),
                "args": {}}

    events = (_process(10, "learner-rank0", ["startup", "learner"]) + _process(20, "generator", ["engine", "g0"])
              + [span(10, 1, "tokenizer", 2, 0.5), span(10, 1, "build engine", 3, 9), span(20, 1, "import vllm", 1, 5),
                 span(20, 1, "held", 6, 4), span(20, 1, "build engine", 10, 18), span(20, 2, "generate", 30, 1.5),
                 dict(span(10, 2, "step", 12, 25), args={"step": 0}), span(10, 2, "wait", 12, 19.5),
                 span(10, 2, "train", 31.5, 5)])
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "metrics.jsonl").write_text("")

    out = timeline.summary(tmp_path, launched=launched, skip=0)

    assert [p["phase"] for p in out["startup"]] == [
        "engine: import vllm", "startup: tokenizer", "startup: build engine", "engine: held", "engine: build engine",
        "first wait",
        "first generate", "first train"]
    assert out["startup"][-1] == {"phase": "first train", "from_launch_s": 31.5, "s": 5.0}
    assert out["learner"]["launch_to_first_step_s"] == 31.5


def test_the_held_out_accuracy_of_each_round_comes_with_the_speed(tmp_path: Path) -> None:
    events = _process(10, "learner-rank0", ["startup", "hub", "learner"]) + _steps(10, 3, 12, 3_000_000)
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "metrics.jsonl").write_text("")
    rounds = [{"version": 10, "eval/pass@1": 0.40625}, {"version": 0, "eval/pass@1": 0.15234375}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))

    assert timeline.summary(tmp_path, skip=2)["heldout_pass@1"] == {"0": 0.1523, "10": 0.4062}
    (tmp_path / "eval.jsonl").unlink()  # a run without evaluation rounds
    assert timeline.summary(tmp_path, skip=2)["heldout_pass@1"] == {}


def test_a_step_that_waited_names_the_group_it_waited_for(tmp_path: Path) -> None:
    """`--waits`: the group whose generation ended last before a wait did, how long it generated, and the groups that
    started on its engine meanwhile (the next batch's, sharing its decode steps; issue 52's k = 1 waits)."""
    s = 1_000_000

    def span(pid: int, tid: int, name: str, at: float, dur: float, **args) -> dict:
        return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": int(at * s), "dur": int(dur * s), "args": args}

    events = (_process(10, "learner-rank0", ["learner"]) + _process(11, "learner-rank1", ["learner"])
              + _process(20, "generator", ["g0", "g1", "g2", "g3"]) + _process(30, "generator", ["g0"]))
    for step, (start, wait) in enumerate([(0.0, 0.01), (1.0, 0.01), (2.0, 0.3), (3.3, 0.02)]):
        for rank in (10, 11):  # every rank records its steps: the run's are rank 0's
            events += [span(rank, 1, "step", start, 1.0, step=step), span(rank, 1, "wait", start, wait)]
    events += [span(10, 1, "early", 2.0, 0.05)]  # computed while it waited: not waiting
    events += [span(20, 1, "generate", 1.5, 0.79, tokens=300),  # the batch's last group: ends at 2.29
               span(20, 2, "generate", 1.6, 0.2, tokens=40),  # started beside it, ended before it
               span(20, 3, "generate", 2.1, 0.5, tokens=90),  # started beside it, still generating when it ended
               span(20, 4, "generate", 2.4, 0.1, tokens=20),  # after it
               span(30, 1, "generate", 1.7, 0.3, tokens=50)]  # another engine's
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))

    out = timeline.waits(tmp_path, skip=1, least=0.05)

    assert out["steps"] == 1 and out["wait_s"] == 0.25
    assert out["rows"] == [{"step": 2, "wait_s": 0.25, "generated_s": 0.79, "before_wait_end_s": 0.01, "tokens": 300,
                            "started_beside": 2, "generating_at_end": 1}]
    assert timeline.waits(tmp_path, skip=1, least=0.5)["steps"] == 0
