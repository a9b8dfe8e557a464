"""What holds a run back: one stage named from the per-step sums that metrics.jsonl already records.

A step's record says where the learner's time went (time/wait_s, time/step_s, time/publish_s), what the hub's thread
spent (time/hub/<message>_s) and what the generators' stages gained (gen/<stage>_s, summed over generators). Over a
window of steps the verdict adds them up and asks, in this order:

    the learner waits less than a quarter of its time    learner compute (weights delivery when publishing takes
                                                         longer than training; a wait of 10 % or more with the
                                                         window full 20 % of the time names k's knob too; the
                                                         generators on a learner rank's GPU are named, which
                                                         take turns on it with training)
    the hub's thread is busy half the time or more       the hub
    reward functions run 0.5 s a generator second        rewards
    generators wait for room in the window, or leases    the window, or weights delivery: the larger of the two,
      wait for their weights, 20 % of their time         once it reaches 20 %
    none of these                                        generation throughput

A generator that waits for room while its engine already holds as many sequences as it runs at once records that
wait as `engine_full`, not `wait_room`: a wider window would only queue more in the engine, so that time counts for
generation throughput, not for the window (on two H200s the window was "full" 26 % of such a run's time while its
engine ran its 512 sequences, and k + 1 was the advice; docs/figures.md).

The generators' seconds are shares of their own time (generating + idle, which add up to each one's wall time), so
heartbeats that land unevenly between steps do not skew them. Each learner process's first WARMUP steps are left
out (step 0 waits for the engines to start), and so are steps LONG times the window's mean or more (an evaluation
round, a checkpoint, a compile). The thresholds and why are in docs/design.md ("What holds a run back").

Nothing here times anything: `verdict` is a pure function of the records. The learner (learner/service.py) logs one
every EVERY steps and at the end of the run, with its figures in that step's record (verdict/...), the hub keeps
the latest for `pipeline status`, `pipeline run` prints the run's, and `python -m bench.timeline` reports it.

Whatever binds, a verdict also names the groups gone stale once they reach STALE of the groups trained: dropped by
the hub as they came (staleness/dropped) or stopped by their generators first (staleness/stopped). A group whose
samples outlive k steps while it generates (the longest ones) is generated again (6-9 % at k = 1-4 on the shipped
smollm2 config before a batch waited for such groups: docs/design.md). It names, too, the learner's wait for the
groups whose last chance a batch was (staleness/last_chance_wait_s) once that reaches WAIT_NOTED of its time: the
longest completions set that pace.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

EVERY = 10  # steps between verdicts in the learner's log
WARMUP = 2  # records at a learner's start left out: step 0 waits for the engines, step 1 may compile
LONG = 3.0  # a step this many times the window's mean wall time is left out: an evaluation round, a checkpoint
MIN_STEPS = 3  # fewer steps than this say nothing

LEARNER_WAITS = 0.25  # the learner waits at least this share of its time: something upstream holds it up
HUB_BUSY = 0.5  # the hub's one thread busy this share of the time: its answers start to queue
REWARDS = 0.5  # reward-function seconds per generator second
WAITS = 0.2  # generators waiting for room (the window) or for weights, this share of their time
RISE = 1.1  # steps/min after a generator joined (or k rose) against before: less than this did not rise
WAIT_NOTED = 0.1  # a learner-bound run that still waits this share with the window full is told of the window too
STALE = 0.05  # groups gone stale (dropped or stopped), as a share of those trained, that every verdict names

LEARNER, GENERATION, WINDOW, WEIGHTS, HUB, REWARD = ("learner compute", "generation throughput", "the window",
                                                     "weights delivery", "the hub", "rewards")
STAGES = (LEARNER, GENERATION, WINDOW, WEIGHTS, HUB, REWARD)
# the generators' shares a verdict reads, and the stage of theirs (protocol.STAGES) each is of
SHARES = {"generating": "generating", "window_full": "wait_room", "engine_full": "engine_full",
          "wait_weights": "wait_version", "rewards": "score"}


@dataclass(frozen=True)
class Verdict:
    stage: str  # one of STAGES
    share: float  # the figure the sentence names (rewards: reward-function seconds per generator second, may pass 1)
    sentence: str  # what binds, the figure, the knob
    first: int  # the steps it read
    last: int
    steps: int
    left_out: int  # long steps left out
    figures: dict[str, float] = field(default_factory=dict)  # every share it computed

    def line(self) -> str:
        left = f", {self.left_out} long left out" if self.left_out else ""
        return f"steps {self.first}-{self.last}{left}: {self.sentence}"

    def fields(self) -> dict:
        """For a metrics record."""
        return {"verdict/stage": self.stage, "verdict/share": round(self.share, 4), "verdict/steps": self.steps,
                **{f"verdict/{k}": round(v, 4) for k, v in self.figures.items()}}


def timed(records: Sequence[dict], start: int = 0) -> list[tuple[dict, float]]:
    """Each step's record with its wall time (time/elapsed_s since the record before), but the first WARMUP records
    of each learner process. A process starts at records[start] (negative: before the first of `records`) and
    wherever time/elapsed_s goes back (a resumed run's learner)."""
    out, begun = [], start
    for i in range(1, len(records)):
        prev, rec = records[i - 1], records[i]
        if rec["time/elapsed_s"] < prev["time/elapsed_s"]:
            begun = i
        if i - begun >= WARMUP:
            out.append((rec, rec["time/elapsed_s"] - prev["time/elapsed_s"]))
    return out


def totals(records: Sequence[dict], prefixes: tuple[str, ...] = ("gen/", "time/")) -> dict[str, float]:
    """The sums of every number whose key starts with one of `prefixes`."""
    out: dict[str, float] = {}
    for r in records:
        for k, v in r.items():
            if k.startswith(prefixes) and isinstance(v, (int, float)):
                out[k] = out.get(k, 0.0) + v
    return out


def verdict(pairs: Sequence[tuple[dict, float]], lora: bool = False) -> Verdict | None:
    """The stage that bound these steps ((record, wall seconds), from `timed`); None for fewer than MIN_STEPS. `lora`:
    the run trains adapters already, so the learner's knobs leave `model.lora` out."""
    kept = _usual(pairs)
    if len(kept) < MIN_STEPS:
        return None
    f = _figures([r for r, _ in kept], sum(w for _, w in kept))
    last = kept[-1][0]
    k, shared = last.get("max_staleness", 1), last.get("generators_on_learner_gpus", 0)
    stage, share, sentence = _decide(f, k, lora, shared, bool(last.get("mps")))
    if f["stale"] >= STALE:
        sentence += (f"; {_pct(f['stale'])} as many groups as were trained went stale before their step and were "
                     f"generated again (samples that outlive k steps: the longest), where "
                     f"`trainer.max_staleness={k + 1}` or a smaller `sampling.max_tokens` keeps them")
    if f["last_chance"] >= WAIT_NOTED:
        sentence += (f"; {_pct(f['last_chance'])} of the learner's time went to batches waiting for groups on their "
                     f"last step (the longest completions, trainer.last_chance_wait_s): "
                     f"`trainer.max_staleness={k + 1}` or a smaller `sampling.max_tokens` shortens it")
    return Verdict(stage, share, sentence, kept[0][0]["step"], kept[-1][0]["step"], len(kept),
                   len(pairs) - len(kept), {name: v for name, v in f.items() if name != "score_per_group"})


def _usual(pairs: Sequence[tuple[dict, float]]) -> list[tuple[dict, float]]:
    """The steps shorter than LONG times the mean: a single long one (an evaluation round, a checkpoint) is left out,
    steps that alternate (batches taken in runs of k + 1) are not."""
    if not pairs:
        return []
    mean = sum(w for _, w in pairs) / len(pairs)
    return [(r, w) for r, w in pairs if w < LONG * mean]


def _figures(records: list[dict], wall: float) -> dict[str, float]:
    """Shares of the learner's wall time, of the hub thread's, and of the generators' own time."""
    t = totals(records)
    # the learner's compute: its steps, and what it computed of a batch while waiting for the rest (learner/early.py)
    train = t.get("time/step_s", 0.0) + t.get("time/early_s", 0.0)
    f = {"wait": t.get("time/wait_s", 0.0) / wall, "train": train / wall,
         "publish": t.get("time/publish_s", 0.0) / wall,
         "hub_busy": sum(v for k, v in t.items() if k.startswith("time/hub/")) / wall}
    groups = sum(len(r["trained"]) if "trained" in r else r.get("groups", 0) for r in records)
    f["stale"] = sum(r.get("staleness/dropped", 0) + r.get("staleness/stopped", 0) for r in records) / max(1, groups)
    f["last_chance"] = sum(r.get("staleness/last_chance_wait_s", 0.0) for r in records) / wall
    gen = t.get("gen/generating_s", 0.0) + t.get("gen/idle_s", 0.0)  # the generators' seconds in these steps
    if gen > 0:
        for name, stage in SHARES.items():
            f[name] = t.get(f"gen/{stage}_s", 0.0) / gen
        f["score_per_group"] = t.get("gen/score_s", 0.0) / max(1, groups)
    return f


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %"


def _decide(f: dict[str, float], k: int, lora: bool = False, shared: int = 0,
            mps: bool = False) -> tuple[str, float, str]:
    """(stage, its figure, the sentence with the knob) from the shares of `_figures`; `shared`: generators on a
    learner rank's GPU, whose time they and training take in turns (`mps`: share, under CUDA MPS)."""
    waited = f"the learner waited {_pct(f['wait'])} of its time"
    if f["wait"] < LEARNER_WAITS:
        if f["publish"] > f["train"]:
            return WEIGHTS, f["publish"], (
                f"publishing each version took {_pct(f['publish'])} of the step, training {_pct(f['train'])}: "
                "`weights.delta` or another `weights.transport` moves it")
        room = f.get("window_full", 0.0)
        window = (f"; the window was full {_pct(room)} of the generators' time, so `trainer.max_staleness={k + 1}` "
                  "may take the wait" if f["wait"] >= WAIT_NOTED and room >= WAITS else "")
        knobs = ["`trainer.micro_batch_tokens`", "`trainer.compile`", "more learner GPUs"]
        if not lora:  # not to a run that trains adapters already
            knobs.append("`model.lora`")
        many = shared > 1
        own = ("a generator on a GPU of its own (`run.generator_gpus`, `pipeline generator --gpus`) leaves training "
               "the whole GPU")
        they = f"; {shared} generator{'s' if many else ''} on the learner's GPUs"
        beside = ("" if not shared else
                  f"{they} share{'' if many else 's'} them with training under CUDA MPS: {own}" if mps else
                  f"{they} take{'' if many else 's'} turns on them with training: {own}, and CUDA MPS "
                  "(`run.mps: true`) lets their kernels run beside training's")
        return LEARNER, f["train"], (
            f"training took {_pct(f['train'])} of the step, waiting for rollouts {_pct(f['wait'])}: the learner sets "
            f"the pace; {', '.join(knobs[:-1])} or {knobs[-1]} move it" + beside + window)
    if f["hub_busy"] >= HUB_BUSY:
        return HUB, f["hub_busy"], (
            f"the hub's thread was busy {_pct(f['hub_busy'])} of the time and {waited}: fewer, larger messages "
            "(`generator.lease_size`, `hub.heartbeat_s`) move it")
    if f.get("rewards", 0.0) >= REWARDS:
        return REWARD, f["rewards"], (
            f"the reward functions took {f['score_per_group']:.2f} s a group, {f['rewards']:.1f} s for every second "
            f"of the generators', and {waited}: faster reward functions, or another generator "
            "(`pipeline generator --learner ADDR`) to score more at once, move it")
    room, weights = f.get("window_full", 0.0), f.get("wait_weights", 0.0)
    if max(room, weights) >= WAITS and room >= weights:
        more = "a batch generate while a step trains" if k == 0 else f"{k + 1} batches generate while a step trains"
        return WINDOW, room, (
            f"the window was full {_pct(room)} of the generators' time and {waited}: "
            f"`trainer.max_staleness={k + 1}` lets {more}")
    if weights >= WAITS:
        return WEIGHTS, weights, (
            f"leases waited for their weights version {_pct(weights)} of the generators' time and {waited}: "
            "`weights.delta`, another `weights.transport` or `generator.update_mode=inflight` moves it")
    busy = f" while the engines generated {_pct(f['generating'])} of theirs" if "generating" in f else ""
    full = f.get("engine_full", 0.0)
    if full >= WAITS:
        busy += (f" and were full {_pct(full)} of it, where a wider window (`trainer.max_staleness`) would only queue "
                 "more")
    return GENERATION, f.get("generating", f["wait"]), (
        f"{waited} for rollouts{busy}: another generator (`pipeline generator --learner ADDR`), on a GPU of its own "
        "or beside an engine on the same GPU, moves it")


def slim(record: dict) -> dict:
    """What the verdict reads of a record (a learner keeps its last few without their trained keys)."""
    out = {k: v for k, v in record.items() if k.startswith(("time/", "gen/"))}
    out.update({k: record.get(k, 0) for k in ("step", "generators", "generators_on_learner_gpus", "mps",
                                              "max_staleness", "staleness/dropped", "staleness/stopped",
                                              "staleness/last_chance_wait_s")})
    out["groups"] = len(record.get("trained", ())) or record.get("groups", 0)
    return out


class Verdicts:
    """One learner process's verdicts as its records come (`add`): one every `every` steps over the steps since the
    last (`due`), and, `every` steps after generators rose or k changed, whether steps/min rose with them
    (`changed`)."""

    def __init__(self, every: int = EVERY, lora: bool = False):
        self.every, self.lora = every, lora  # lora: as `verdict`'s
        self.records: deque[dict] = deque(maxlen=2 * every + 2)
        self.seen = 0  # records of this process

    def add(self, record: dict) -> Verdict | None:
        """Keep `record` (its `slim` copy); the verdict when one is due (`due`)."""
        self.records.append(slim(record))
        self.seen += 1
        return self.due()

    def _steps(self, first: int, last: int | None = None) -> list[tuple[dict, float]]:
        """`timed` over the kept records[first:last]: this process's warm-up left out where its start is there."""
        records = list(self.records)
        return timed(records[first:last], len(records) - self.seen - first)

    def due(self) -> Verdict | None:
        """The verdict over the last `every` steps, at every `every`-th step (none when `every` is 0)."""
        if not self.every or not self.records or (self.records[-1]["step"] + 1) % self.every:
            return None
        return verdict(self._steps(max(0, len(self.records) - self.every - 1)), self.lora)

    def changed(self) -> str | None:
        """`every` steps after the generators rose or k changed (`pipeline set trainer.max_staleness`): steps/min
        before and after, and when it did not rise by RISE, why: the verdict after a join; after a wider window, that
        the engines made no more with more in flight, which only a run at the new k can tell (docs/figures.md: on a
        GPU shared with training, k = 3 ran slower than k = 2, though the window was full at k = 2)."""
        recs = list(self.records)
        j = len(recs) - self.every - 1  # the record of the step in which they joined, or k changed
        if j < 1:
            return None
        (gens0, k0), (gens, k) = ((r["generators"], r["max_staleness"]) for r in (recs[j - 1], recs[j]))
        if gens <= gens0 and k == k0:
            return None
        before, after = self._steps(0, j)[-self.every:], self._steps(j)
        if len(before) < MIN_STEPS or len(after) < MIN_STEPS:
            return None
        was, now = rate(before), rate(after)
        what = f"generators {gens0} -> {gens}" if gens > gens0 else f"trainer.max_staleness {k0} -> {k}"
        head = f"{what} at step {recs[j]['step']}: {was:.1f} -> {now:.1f} steps/min"
        if now >= RISE * was:
            return head
        if gens > gens0:
            why = verdict(after, self.lora)
            return f"{head}, no faster" + (f": {why.sentence}" if why else "")
        if k < k0:
            return f"{head}, no faster"
        return (f"{head}, no faster: the engines made no more with more batches in flight (at their limit, or sharing "
                f"a GPU with training); `pipeline set trainer.max_staleness={k0}` sets it back, and a generator on a "
                "GPU of its own (`pipeline generator --learner ADDR`) adds throughput")


def rate(pairs: Sequence[tuple[dict, float]]) -> float:
    """Steps per minute over (record, wall seconds) pairs."""
    return 60 * len(pairs) / max(1e-9, sum(w for _, w in pairs))
