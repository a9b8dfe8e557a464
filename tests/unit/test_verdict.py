"""What holds a run back (pipeline/verdict.py): each stage wins on the records of a run it binds, the figures measured
on an H200 read as they should, warm-up and long steps are left out, a join says why steps/min did not rise, and the
verdict changes no other field of a learner's records."""

from __future__ import annotations

import copy
import types

import pytest

from pipeline import protocol as P
from pipeline import verdict as V
from pipeline.status import render


def records(steps: list[dict], first: int = 0, generators: int = 1, k: int = 1) -> list[dict]:
    """Metrics records of consecutive steps; each of `steps` gives a step's wall time (`wall`), the learner's phases
    (wait, train, publish), the hub thread's seconds (hub) and the generators' seconds per stage (the rest, summed
    over generators; idle: what generating leaves of their wall time unless given)."""
    out, elapsed = [], 0.0
    for i, s in enumerate(steps):
        s = dict(s)
        wall = s.pop("wall")
        elapsed += wall
        gens = s.pop("generators", generators)
        r = {"step": first + i, "time/elapsed_s": elapsed, "time/wait_s": s.pop("wait", 0.0),
             "time/step_s": s.pop("train", 0.0), "time/publish_s": s.pop("publish", 0.0),
             "time/hub/rollout_s": s.pop("hub", 0.0), "generators": gens, "max_staleness": s.pop("k", k),
             "trained": [[0, i, 0, "g"]] * 16}
        if s:
            s.setdefault("idle", max(0.0, gens * wall - s.get("generating", 0.0)))
            r.update({f"gen/{name}_s": v for name, v in s.items()})
        out.append(r)
    return out


def judge(steps: list[dict], **kw) -> V.Verdict:
    v = V.verdict(V.timed(records([{"wall": 60.0, "wait": 59.0}, {"wall": 1.0}] + steps, **kw)))
    assert v is not None
    return v


# one step of each kind of run: the learner's phases and what the generators did meanwhile (one generator)
LEARNER_BOUND = {"wall": 1.0, "wait": 0.02, "train": 0.95, "publish": 0.01, "generating": 0.3, "wait_room": 0.7}
STAGE_RUNS = {
    V.LEARNER: LEARNER_BOUND,
    V.WEIGHTS: {"wall": 1.0, "wait": 0.05, "train": 0.3, "publish": 0.6, "generating": 0.3, "wait_room": 0.9},
    V.HUB: {"wall": 1.0, "wait": 0.6, "train": 0.35, "hub": 0.7, "generating": 0.5, "lease": 0.4},
    # rewards before the window: groups scoring hold the window's room too
    V.REWARD: {"wall": 1.0, "wait": 0.7, "train": 0.25, "generating": 0.2, "score": 3.0, "wait_room": 0.6},
    V.WINDOW: {"wall": 1.0, "wait": 0.45, "train": 0.5, "generating": 0.85, "wait_room": 0.8, "wait_version": 0.05},
    V.GENERATION: {"wall": 1.0, "wait": 0.6, "train": 0.35, "generating": 0.97, "wait_room": 0.02, "score": 0.01},
}


@pytest.mark.parametrize("stage", list(STAGE_RUNS))
def test_each_stage_wins_on_the_run_it_binds(stage):
    v = judge([STAGE_RUNS[stage]] * 8)
    assert v.stage == stage, v.line()
    assert v.steps == 8 and (v.first, v.last) == (2, 9)


def test_leases_waiting_for_their_weights_name_the_weights():
    v = judge([{"wall": 1.0, "wait": 0.5, "train": 0.45, "generating": 0.6, "wait_version": 0.45,
                "wait_room": 0.1}] * 8)
    assert v.stage == V.WEIGHTS and v.share == pytest.approx(0.45)
    assert "`weights.delta`" in v.sentence


def test_each_sentence_gives_its_figure_and_knob():
    knobs = {V.LEARNER: "`trainer.micro_batch_tokens`", V.WEIGHTS: "`weights.transport`",
             V.HUB: "`generator.lease_size`", V.REWARD: "`pipeline generator --learner ADDR`",
             V.WINDOW: "`trainer.max_staleness=2` lets 2 batches generate",
             V.GENERATION: "`pipeline generator --learner ADDR`"}
    for stage, knob in knobs.items():
        v = judge([STAGE_RUNS[stage]] * 8)
        assert knob in v.sentence, v.sentence
        assert stage == V.REWARD or f"{100 * v.share:.0f} %" in v.sentence, v.sentence
    rewards = judge([STAGE_RUNS[V.REWARD]] * 8)
    assert "0.19 s a group" in rewards.sentence  # 3 s of scoring a step, 16 groups
    k0 = judge([STAGE_RUNS[V.WINDOW]] * 8, k=0)
    assert "`trainer.max_staleness=1` lets a batch generate while a step trains" in k0.sentence


# Measured on one H200, configs/gpu-smollm2-math.yaml colocated, 150 steps (docs/figures.md): per step
H200_K1 = {"wall": 0.438, "wait": 0.18, "train": 0.21, "publish": 0.01, "hub": 0.01,
           "generating": 0.39, "wait_room": 0.372, "score": 0.004, "wait_version": 0.01}  # 137 steps/min
H200_K2 = {"wall": 0.252, "wait": 0.005, "train": 0.188, "publish": 0.01, "hub": 0.01,
           "generating": 0.22, "wait_room": 0.15, "score": 0.004}  # 179.6 steps/min, median wait ~0
H200_K2_EVAL = {"wall": 1.3, "wait": 1.05, "train": 0.19, "publish": 0.01, "hub": 0.02,
                "generating": 1.2, "wait_room": 0.1}  # an evaluation round every 10 steps
SPLIT_1_5B = {"wall": 6.38, "wait": 0.89, "train": 5.45, "publish": 0.04, "generating": 6.2, "wait_room": 0.1}
# the split 1.5B run at k = 2 on two H200s (2026-11-29): the learner waited 23 %, the window full 94 %
SPLIT_1_5B_K2 = {"wall": 7.1, "wait": 1.65, "train": 5.41, "publish": 0.04, "generating": 6.6, "wait_room": 6.7}


def test_the_h200_runs_read_as_measured():
    """k = 1 waits on the window (the generator waits for room, the learner for the batch); k = 2 and the split 1.5B
    run are bound by the learner's compute."""
    assert judge([H200_K1] * 9).stage == V.WINDOW
    k2 = judge([H200_K2] * 4 + [H200_K2_EVAL] + [H200_K2] * 5, k=2)
    assert k2.stage == V.LEARNER and k2.left_out == 1, k2.line()
    assert k2.share == pytest.approx(0.188 / 0.252, abs=0.01)  # train ~ 75 % of the step
    assert judge([SPLIT_1_5B] * 9).stage == V.LEARNER


# the split 1.5B run at k = 3 on two H200s (2026-11-30, 512 sequences an engine): the learner waited 34 %, and the
# generator waited for room 26 % of its time while its engine ran the 512 sequences it runs at once
SPLIT_1_5B_K3 = {"wall": 8.63, "wait": 2.97, "train": 5.6, "publish": 0.05, "generating": 8.62}


def test_waits_for_room_with_the_engine_full_count_for_generation_not_the_window():
    """The split run's verdict was "the window" with `trainer.max_staleness=4` as the knob, while its engine already
    ran all the sequences it could: recorded as `engine_full`, those waits name generation throughput, and the
    sentence says a wider window would only queue more."""
    assert judge([dict(SPLIT_1_5B_K3, wait_room=2.26)] * 9, k=3).stage == V.WINDOW  # what the run said
    v = judge([dict(SPLIT_1_5B_K3, engine_full=2.26)] * 9, k=3)
    assert v.stage == V.GENERATION and v.figures["engine_full"] == pytest.approx(2.26 / 8.63, abs=0.01), v.line()
    assert "full 26 %" in v.sentence and "would only queue more" in v.sentence
    assert "max_staleness=4" not in v.sentence
    # a learner-bound run is not told that k + 1 may take its wait when its engine was the one full
    one = {"wall": 11.0, "wait": 1.9, "train": 9.0, "generating": 11.0}  # one GPU at k = 2 (2026-11-30)
    assert "max_staleness=3" in judge([dict(one, wait_room=8.7)] * 9, k=2).sentence
    learner = judge([dict(one, engine_full=8.7)] * 9, k=2)
    assert learner.stage == V.LEARNER and "max_staleness" not in learner.sentence, learner.line()


def test_a_run_that_trains_adapters_is_not_told_to_train_adapters():
    """The learner's knobs name `model.lora` only to a run without it (a SmolLM2 QLoRA run was told to use it)."""
    pairs = V.timed(records([{"wall": 60.0, "wait": 59.0}, {"wall": 1.0}] + [LEARNER_BOUND] * 8))
    assert "`model.lora`" in V.verdict(pairs).sentence
    lora = V.verdict(pairs, lora=True)
    assert lora.stage == V.LEARNER and "`model.lora`" not in lora.sentence and "more learner GPUs" in lora.sentence
    verdicts = V.Verdicts(lora=True)
    due = [v for r in records([{"wall": 60.0, "wait": 59.0}, {"wall": 1.0}] + [LEARNER_BOUND] * 8)
           if (v := verdicts.add(r))]
    assert len(due) == 1 and "`model.lora`" not in due[0].sentence, due


def test_a_long_step_is_left_out_and_alternating_steps_are_not():
    """The evaluation round's step alone would make k = 2 look upstream-bound (its wait is 30 % of the window)."""
    with_round = [H200_K2] * 4 + [H200_K2_EVAL] + [H200_K2] * 5
    whole = V._figures([r for r, _ in V.timed(records([{"wall": 1.0}] * 2 + with_round))],
                       sum(s["wall"] for s in with_round))
    assert whole["wait"] > V.LEARNER_WAITS  # kept, it would have read "upstream"
    # k = 1 on a CPU: batches taken in runs of two, a step waiting, the next not (3x apart): all are read
    short = {"wall": 0.06, "wait": 0.0, "train": 0.05, "generating": 0.03, "wait_room": 0.05}
    long = {"wall": 0.2, "wait": 0.14, "train": 0.05, "generating": 0.15, "wait_room": 0.15}
    v = judge([short, long] * 5)
    assert v.left_out == 0 and v.steps == 10 and v.stage == V.WINDOW


def test_heartbeats_that_land_unevenly_do_not_skew_the_generators_shares():
    """A generator's seconds reach the records with its heartbeats: here every third step or so, the window's first
    one bringing a step's worth from before it (9 s of its time in 8 s of the window's). Its shares are of its own
    seconds, not of the window's wall time."""
    lumps = [{"wall": 1.0, "wait": 0.5, "train": 0.45, "generating": 0.5 * n, "wait_room": 0.8 * n, "idle": 0.5 * n}
             for n in (2, 0, 0, 3, 0, 0, 3, 1)]
    v = judge(lumps)
    assert v.stage == V.WINDOW and v.figures["window_full"] == pytest.approx(0.8)
    assert v.figures["generating"] == pytest.approx(0.5)


def test_warm_up_is_left_out_at_the_start_and_after_a_resume():
    run = records([{"wall": 74.0, "wait": 74.0}] + [{"wall": 0.3, "train": 0.28, "wait": 0.01}] * 9)
    resumed = records([{"wall": 50.0, "wait": 50.0}] + [{"wall": 0.3, "train": 0.1, "wait": 0.19}] * 9, first=10)
    pairs = V.timed(run + resumed)
    assert [r["step"] for r, _ in pairs] == list(range(2, 10)) + list(range(12, 20))
    assert all(w == pytest.approx(0.3) for _, w in pairs)
    assert V.verdict(pairs[:2]) is None  # too few steps say nothing


def test_the_verdict_reads_its_records_and_changes_none():
    rs = records([{"wall": 1.0, "wait": 1.0}] + [STAGE_RUNS[V.WINDOW]] * 12)
    before = copy.deepcopy(rs)
    V.verdict(V.timed(rs))
    verdicts = V.Verdicts()
    for r in rs:
        verdicts.add(r)
        verdicts.changed()
    assert rs == before


def test_a_verdict_every_ten_steps_over_the_ten_before():
    verdicts, due = V.Verdicts(), {}
    for r in records([{"wall": 30.0, "wait": 30.0}] + [LEARNER_BOUND] * 9 + [STAGE_RUNS[V.WINDOW]] * 15):
        if (v := verdicts.add(r)) is not None:
            due[r["step"]] = v
    assert list(due) == [9, 19]
    assert (due[9].first, due[9].last, due[9].stage) == (2, 9, V.LEARNER)  # steps 0 and 1 left out
    assert (due[19].first, due[19].last, due[19].steps, due[19].stage) == (10, 19, 10, V.WINDOW)
    assert due[9].fields()["verdict/stage"] == V.LEARNER and due[9].line().startswith("steps 2-9: training took")


def _join(before: dict, after: dict, **change) -> list[str]:
    """What the verdicts said of `after` steps following `before` steps, with `change` (default: a second generator)."""
    verdicts, said = V.Verdicts(), []
    steps = [{"wall": 30.0, "wait": 30.0}] + [before] * 14 + [dict(after, **(change or {"generators": 2}))] * 12
    for r in records(steps):
        verdicts.add(r)
        if line := verdicts.changed():
            said.append(line)
    return said


def test_a_generator_that_joins_a_full_window_is_named_as_no_faster():
    window = dict(STAGE_RUNS[V.WINDOW])
    (said,) = _join(window, dict(window, generating=1.0, wait_room=1.7))  # two generators' seconds
    assert said.startswith("generators 1 -> 2 at step 15: 60.0 -> 60.0 steps/min, no faster: the window was full")
    assert "`trainer.max_staleness=2`" in said


def test_a_generator_that_speeds_the_run_up_is_named_without_a_why():
    slow = STAGE_RUNS[V.GENERATION]
    (said,) = _join(slow, dict(slow, wall=0.5, wait=0.1, generating=0.9))
    assert said == "generators 1 -> 2 at step 15: 60.0 -> 120.0 steps/min"


# the 1.5B shape on one H200 (2026-11-29): at k = 2 the window was full 95 % and the learner waited 22 %; at k = 3
# each batch took twice as long on the engine sharing the learner's GPU, and the learner waited 41 %
ONE_1_5B_K2 = {"wall": 11.1, "wait": 2.4, "train": 8.6, "publish": 0.03, "generating": 11.1, "wait_room": 10.5}
ONE_1_5B_K3 = {"wall": 13.2, "wait": 5.4, "train": 7.7, "publish": 0.03, "generating": 13.2, "wait_room": 12.4}


def test_a_wider_window_that_does_not_pay_is_named_with_the_way_back():
    (said,) = _join(dict(ONE_1_5B_K2, k=2), ONE_1_5B_K3, k=3)
    assert said.startswith("trainer.max_staleness 2 -> 3 at step 15: 5.4 -> 4.5 steps/min, no faster: the engines"), \
        said
    assert "`pipeline set trainer.max_staleness=2` sets it back" in said
    assert "the window was full" not in said  # the verdict at k = 3 would propose k = 4 again


def test_a_wider_window_that_pays_is_named_without_a_why():
    (said,) = _join(H200_K1, H200_K2, k=2)
    assert said == "trainer.max_staleness 1 -> 2 at step 15: 137.0 -> 238.1 steps/min"


def test_the_status_shows_the_latest_verdict_and_an_older_peer_decodes_without_it():
    status = P.StatusReply("run", 3, 1, 16, 0, 0, 0, 0, {}, verdict="steps 2-9: the window was full 80 %")
    assert "bound: steps 2-9: the window was full 80 %" in render(status)
    back, _ = P.decode(P.encode(status))
    assert back.verdict == status.verdict
    import msgpack

    older = msgpack.unpackb(P.encode(status))
    del older["verdict"]  # a learner of an earlier release: the field appended since has its default
    assert P.decode(msgpack.packb(older))[0].verdict == ""


def test_pipeline_status_gets_the_learners_latest_verdict(tmp_path):
    from tests.unit.peers import Peer, new_hub

    hub = new_hub(tmp_path)
    peer = Peer(hub, "operator")
    try:
        assert peer.ask(P.StatusRequest()).verdict == ""
        hub.set_verdict("steps 2-9: training took 95 % of the step")
        assert "bound: steps 2-9: training took 95 % of the step" in render(peer.ask(P.StatusRequest()))
    finally:
        peer.close()
        hub.stop()


def test_a_generators_time_before_its_first_report_is_no_steps():
    """A generator that joins counts its seconds from its own start (its engine's build): the step it joins in must
    not read tens of idle seconds."""
    from hub.trainer import HubStats
    from learner.timeline import StepTimes

    def seen(stages: dict) -> HubStats:
        return HubStats(tokens=0, generators=len(stages), counters={}, busy={}, stages=stages)

    times = StepTimes(seen({}))
    assert not [k for k in times.record(seen({"g": {}})) if k.startswith("gen/")]  # registered, no heartbeat yet
    first = {"g": {"idle": 40.0, "generating": 0.5}}  # its first heartbeat: 40 s building its engine
    assert not [k for k in times.record(seen(first)) if k.startswith("gen/")]
    gained = times.record(seen({"g": {"idle": 40.1, "generating": 1.4}}))
    assert gained["gen/idle_s"] == pytest.approx(0.1) and gained["gen/generating_s"] == pytest.approx(0.9)


def test_the_learner_writes_the_same_records_with_the_verdict_as_without(tmp_path, monkeypatch):
    """The verdict is computed from the step's record once it is whole and only adds its own fields (verdict/...):
    the learner's record path replayed step for step (a fixed clock, the same hub and phases) writes every other
    field the same with verdicts on and off."""
    from hub.trainer import HubStats
    from learner import service
    from pipeline import trace
    from pipeline.config import Config
    from pipeline.metrics import MetricsWriter, read_metrics

    class Off:  # no verdict: none of its code runs
        def add(self, record):
            return None

        def changed(self):
            return None

    def replay(run_dir, verdicts) -> tuple[list[dict], list[str]]:
        clock = types.SimpleNamespace(now=0.0)
        monkeypatch.setattr(service, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
        said: list[str] = []
        hub = types.SimpleNamespace(counters={"tokens": 0}, busy=trace.Sums(), stages={"g": {}}, evaluations=list,
                                    set_verdict=said.append)
        hub.step_stats = lambda: HubStats(tokens=hub.counters["tokens"], generators=1, counters=dict(hub.counters),
                                          busy=dict(hub.busy), stages=copy.deepcopy(hub.stages))
        publisher = types.SimpleNamespace(metrics=lambda: {"sync/broadcast_ms": 1.0})
        run_dir.mkdir()
        learner = service.Learner(Config(), None, None, hub=hub, publisher=publisher, metrics=MetricsWriter(run_dir),
                                  run_dir=run_dir)
        learner.verdicts = verdicts
        for step in range(25):
            s = STAGE_RUNS[V.WINDOW] if step % 7 else LEARNER_BOUND  # a mixed run
            clock.now += s["wall"]
            hub.counters["tokens"] += 1000
            hub.busy.add("rollout", 0.01)
            g = hub.stages["g"]
            hub.stages["g"] = {"generating": g.get("generating", 0.0) + s["generating"],
                               "idle": g.get("idle", 0.0) + s["wall"] - s["generating"],
                               "wait_room": g.get("wait_room", 0.0) + s["wait_room"]}
            learner.times.sums = trace.Sums({"wait": s["wait"], "train": s["train"], "publish": 0.01})
            learner.record(hub, step, {"reward/mean": step / 25, "staleness/max_lag": 1, "loss": 0.1 * step},
                           {"trainer.max_staleness": 1}, [], 3.0)
        return read_metrics(run_dir), said

    on, said = replay(tmp_path / "on", V.Verdicts())
    off, unsaid = replay(tmp_path / "off", Off())
    assert [r["step"] for r in on if "verdict/stage" in r] == [9, 19] and len(said) == 2 and not unsaid
    assert [{k: v for k, v in r.items() if not k.startswith("verdict/")} for r in on] == off
    assert len(off) == 25 and not any(k.startswith("verdict/") for r in off for k in r)


def test_a_learner_bound_run_that_waits_on_a_full_window_is_told_of_k_too():
    split = judge([SPLIT_1_5B_K2] * 9, k=2)
    assert split.stage == V.LEARNER, split.line()
    assert "`trainer.micro_batch_tokens`" in split.sentence and "`trainer.max_staleness=3` may take the wait" in \
        split.sentence, split.sentence
    for quiet in (LEARNER_BOUND, SPLIT_1_5B):  # it hardly waits, or its window has room
        assert "max_staleness" not in judge([quiet] * 9, k=2).sentence


# the GPU-bound 1.5B run colocated on one H200 at k = 2 (2026-12-01): training 9.71 s of a 10.02 s step, 5.46 s with
# the GPU to itself (the split run of SPLIT_1_5B); its engine full 65 % of its time
ONE_GPU_1_5B = {"wall": 10.02, "wait": 0.76, "train": 9.23, "publish": 0.03, "generating": 9.4, "engine_full": 6.5}


def test_a_learner_bound_run_is_told_of_the_generators_that_share_its_gpus():
    """Training beside an engine on its GPU took 9.7 s a step against 5.5 s alone: processes on one GPU take turns.
    A learner-bound verdict names the generators on the learner's GPUs (the record's generators_on_learner_gpus, the
    hub's count) and the knob that gives training the GPU back; a run without them, or bound elsewhere, is not told."""
    def judged(steps, shared, mps=False, **kw):
        recs = records([{"wall": 60.0, "wait": 59.0}, {"wall": 1.0}] + steps, **kw)
        for r in recs:
            r["generators_on_learner_gpus"], r["mps"] = shared, mps
        return V.verdict(V.timed(recs)), recs

    one, recs = judged([ONE_GPU_1_5B] * 9, 1, k=2)
    assert one.stage == V.LEARNER, one.line()
    assert "1 generator on the learner's GPUs takes turns on them with training" in one.sentence, one.sentence
    assert "`run.generator_gpus`" in one.sentence and "`pipeline generator --gpus`" in one.sentence
    assert one.sentence.endswith("and CUDA MPS (`run.mps: true`) lets their kernels run beside training's")
    assert V.slim(recs[-1])["generators_on_learner_gpus"] == 1  # what a learner keeps for its verdicts
    # under CUDA MPS (the record's `mps`: pipeline/mps.py) they do not take turns, and run.mps is not offered again
    mps, recs = judged([ONE_GPU_1_5B] * 9, 1, mps=True, k=2)
    assert mps.stage == V.LEARNER and V.slim(recs[-1])["mps"] is True
    shares = "1 generator on the learner's GPUs shares them with training under CUDA MPS: a generator on a GPU of its"
    assert shares in mps.sentence and "turns" not in mps.sentence and "run.mps" not in mps.sentence, mps.sentence
    two, _ = judged([ONE_GPU_1_5B] * 9, 4, k=2, generators=4)  # two ranks, two engines on each rank's GPU
    assert "4 generators on the learner's GPUs take turns" in two.sentence, two.sentence
    alone, _ = judged([ONE_GPU_1_5B] * 9, 0, k=2)
    assert alone.stage == V.LEARNER and "take" not in alone.sentence and "run.generator_gpus" not in alone.sentence
    assert alone.sentence == one.sentence.split("; 1 generator")[0]
    window, _ = judged([STAGE_RUNS[V.WINDOW]] * 8, 1)  # bound by the window: its knob is k, not the GPU
    assert window.stage == V.WINDOW and "run.generator_gpus" not in window.sentence


def test_groups_dropped_as_stale_are_named_whatever_binds():
    """A run whose groups go stale (their samples outlived k steps while they generated: dropped by the hub, or stopped
    by their generator) regenerates them: from STALE of the groups trained, every verdict says so with the knobs."""
    for stage in (V.LEARNER, V.WINDOW):
        recs = records([{"wall": 60.0, "wait": 59.0}, {"wall": 1.0}] + [STAGE_RUNS[stage]] * 8, k=2)
        quiet = V.verdict(V.timed(recs))
        for r in recs:
            r["staleness/dropped"], r["staleness/stopped"] = 2, 1  # by the hub, by the generator: of 16 trained
        loud = V.verdict(V.timed(recs))
        assert quiet is not None and loud is not None and quiet.stage == loud.stage == stage
        assert "went stale" not in quiet.sentence and loud.sentence.startswith(quiet.sentence)
        assert "19 % as many groups as were trained went stale" in loud.sentence
        assert "`trainer.max_staleness=3`" in loud.sentence and "`sampling.max_tokens`" in loud.sentence
        assert loud.figures["stale"] == pytest.approx(3 / 16)
        kept = V.slim(recs[-1])  # what a learner keeps of a record for its verdicts
        assert kept["staleness/dropped"] == 2 and kept["staleness/stopped"] == 1


def test_a_wait_for_groups_on_their_last_step_is_named_whatever_binds():
    """A batch that waits for groups whose last chance it is (trainer.last_chance_wait_s) waits for the longest
    completions: from WAIT_NOTED of the learner's time, every verdict says so with the knobs, and the learner keeps
    the figure in what it reads of a record."""
    for stage in (V.LEARNER, V.WINDOW):
        recs = records([{"wall": 60.0, "wait": 59.0}, {"wall": 1.0}] + [STAGE_RUNS[stage]] * 8, k=2)
        for r in recs:
            r["staleness/last_chance_wait_s"] = 0.05  # 5 % of each 1 s step: not named
        quiet = V.verdict(V.timed(recs))
        for r in recs:
            r["staleness/last_chance_wait_s"] = 0.2
        loud = V.verdict(V.timed(recs))
        assert quiet is not None and loud is not None and quiet.stage == loud.stage == stage
        assert "last step" not in quiet.sentence and loud.sentence.startswith(quiet.sentence)
        assert "20 % of the learner's time went to batches waiting for groups on their last step" in loud.sentence
        assert "`trainer.max_staleness=3`" in loud.sentence.split("last step")[1]
        assert loud.figures["last_chance"] == pytest.approx(0.2)
        assert V.slim(recs[-1])["staleness/last_chance_wait_s"] == 0.2


def test_what_the_learner_computes_while_it_waits_is_its_compute_not_its_wait():
    """trainer.early_proximal (learner/early.py): the `early` phase lies inside `wait`; the record counts it as
    time/early_s and not in time/wait_s, and the verdict counts it as training. A run that waited 0.4 s of each 1 s
    step, 0.3 s of it computing, is learner-bound (a wait of 10 %), not window-bound (40 %)."""
    import time

    from learner.timeline import StepTimes

    times = StepTimes(None)
    with times.phase("wait"):
        time.sleep(0.02)
        with times.phase("early"):
            time.sleep(0.05)
    record, spans = times.record(None), times.sums
    assert record["time/early_s"] == spans["early"] > 0
    assert record["time/wait_s"] == pytest.approx(spans["wait"] - spans["early"])
    window = dict(STAGE_RUNS[V.WINDOW], wait=0.1, train=0.5)
    runs = records([{"wall": 60.0, "wait": 59.0}, {"wall": 1.0}] + [window] * 6)
    for r in runs[2:]:
        r["time/early_s"] = 0.3
    v = V.verdict(V.timed(runs))
    assert v is not None and v.stage == V.LEARNER and v.figures["train"] == pytest.approx(0.8)
