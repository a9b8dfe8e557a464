"""Where a profiled run's time went: the summary of RUN_DIR/trace.json and metrics.jsonl (`pipeline run --profile`).

    python -m bench.timeline RUN_DIR [--launched UNIX_TIME] [--skip 5]
    python -m bench.timeline RUN_DIR --plot FIRST LAST OUT.png      (a picture of steps FIRST..LAST)
    python -m bench.timeline RUN_DIR --waits [--least 0.05]          (what each step that waited waited for)

Steps before --skip are left out of the rates (start-up, first compilations), and so are the run's last steps that
ended after the engines' last group did (the tail: batches generated ahead, trained with nothing generating beside
them). It prints one JSON object:
    learner    steps/min, median step, train and wait; the share of step time spent waiting; the longest step after
               the skipped ones against the median; the tail's steps left out; launch to the first training step
               (with --launched)
    startup    the start's phases in order, seconds from launch (from the first event without --launched) and long:
               the learner's (tokenizer, build engine, start the hub, publish the first version), each engine's
               (import vllm, held until the hub is up, build engine), then the first batch's first generate, the
               learner's first wait and its first train (the first step's compilations)
    generators completion tokens/s delivered over the steady steps and while any group was generating; the share
               of time with none generating; lease round trips, waits for room and for versions, weights loads,
               score, encode and send (medians and totals); the event loop's lag
    hub        seconds per message kind over the steady steps
    metrics    metrics.jsonl's per-step sums over the steady steps (gen/, time/hub/)
    verdict    what held the steady steps back (pipeline/verdict.py: the learner's log says the same every 10 steps)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from pipeline import trace
from pipeline.metrics import read_jsonl
from pipeline.verdict import timed, totals, verdict


def learner_waits(spans: list[dict]) -> list[tuple[float, float]]:
    """(end, seconds) of each of the learner's waits for a batch, less the `early` spans inside it: the learner's
    compute while it waited (learner/early.py), not waiting."""
    learner = [e for e in spans if e["track"] == "learner"]
    early = [e for e in learner if e["name"] == "early"]

    def computed(w: dict) -> float:
        return sum(x["dur"] for x in early if x["pid"] == w["pid"] and w["ts"] <= x["ts"] < w["ts"] + w["dur"])

    return [((e["ts"] + e["dur"]) / 1e6, (e["dur"] - computed(e)) / 1e6) for e in learner if e["name"] == "wait"]


def _rank0(events: list[dict]) -> list[dict]:
    """The spans of `events`, the learner's of rank 0 alone: every learner rank records its steps and waits, and rank
    0's are the run's (a step counted once per rank doubled steps/min)."""
    others = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
              and e["args"]["name"].startswith("learner-rank") and e["args"]["name"] != "learner-rank0"}
    return [e for e in trace.spans(events) if e["track"] != "learner" or e["pid"] not in others]


def waits(run_dir: Path, skip: int = 5, least: float = 0.05) -> dict:
    """What each steady step that waited at least `least` seconds (less its early compute) waited for: the group whose
    generation ended last before the wait did (the batch's last), how long it generated, its tokens (all its samples),
    and the groups that started on its engine while it generated (the next batch's, sharing its decode steps), with
    how many of the engine's groups were still generating when it ended. A summary of them, and one row a step."""
    spans = _rank0(trace.read(Path(run_dir) / "trace.json"))
    steps = {e["ts"] + e["dur"]: e["args"]["step"] for e in spans if e["track"] == "learner" and e["name"] == "step"}
    generate = [e for e in spans if e["name"] == "generate"]
    rows = []
    for end, seconds in learner_waits(spans):
        step = min((s for t, s in steps.items() if t / 1e6 >= end), default=None)
        if step is None or step < skip or seconds < least:
            continue
        done = [e for e in generate if (e["ts"] + e["dur"]) / 1e6 <= end]
        if not done:
            continue
        last = max(done, key=lambda e: e["ts"] + e["dur"])
        a, b = last["ts"], last["ts"] + last["dur"]
        engine = [e for e in generate if e["pid"] == last["pid"] and e is not last]
        rows.append({"step": step, "wait_s": round(seconds, 3), "generated_s": round(last["dur"] / 1e6, 3),
                     "before_wait_end_s": round(end - b / 1e6, 3), "tokens": last["args"].get("tokens"),
                     "started_beside": sum(1 for e in engine if a < e["ts"] < b),
                     "generating_at_end": sum(1 for e in engine if e["ts"] < b < e["ts"] + e["dur"])})
    out: dict[str, Any] = {"steps": len(rows), "wait_s": round(sum(r["wait_s"] for r in rows), 3)}
    for key in ("wait_s", "generated_s", "started_beside", "generating_at_end"):
        out[f"median_{key}"] = _median([r[key] for r in rows])
    out["rows"] = rows
    return out


def summary(run_dir: Path, launched: float | None = None, skip: int = 5) -> dict:
    events = trace.read(Path(run_dir) / "trace.json")
    spans = _rank0(events)
    steps = [e for e in spans if e["track"] == "learner" and e["name"] == "step"]
    after_skip = [e for e in steps if e["args"]["step"] >= skip] or steps
    steady = while_generating(after_skip, [e for e in spans if e["name"] == "generate"])
    t0, t1 = steady[0]["ts"], steady[-1]["ts"] + steady[-1]["dur"]
    inside = [e for e in spans if t0 <= e["ts"] < t1]

    def named(name: str, track: str | None = None, among=inside) -> list[float]:
        return [e["dur"] / 1e6 for e in among if e["name"] == name and (track is None or e["track"] == track)]

    step_s = [e["dur"] / 1e6 for e in steady]
    train, early = named("train", "learner"), named("early", "learner")
    wait = [s for _, s in learner_waits(inside)]
    first_train = min((e["ts"] / 1e6 for e in spans if e["track"] == "learner" and e["name"] == "train"), default=None)
    out: dict[str, Any] = {"learner": {
        "steps": len(steps), "steady_steps": len(steady), "tail_steps": len(after_skip) - len(steady),
        "steps_per_min": 60 * len(steady) / ((t1 - t0) / 1e6),
        "median_step_s": statistics.median(step_s), "median_train_s": _median(train), "median_wait_s": _median(wait),
        "wait_share": sum(wait) / sum(step_s), "early_share": sum(early) / sum(step_s),
        "longest_step_over_median": max(step_s) / statistics.median(step_s),
        "launch_to_first_step_s": first_train - launched if launched and first_train else None}}
    out["startup"] = startup(spans, launched)
    generate = [e for e in inside if e["name"] == "generate"]
    tokens = sum(e["args"].get("tokens", 0) for e in generate)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in generate], t0, t1) / 1e6
    lags = [e["args"]["ms"] for e in events if e["ph"] == "C" and e["name"] == "event loop lag" and t0 <= e["ts"] < t1]
    out["generators"] = {
        "tokens_per_s": tokens / ((t1 - t0) / 1e6), "tokens_per_s_generating": tokens / busy if busy else None,
        "none_generating_share": 1 - busy / ((t1 - t0) / 1e6), "groups": len(generate),
        **{f"{n}_s": _stats(named(n)) for n in ("lease", "wait_room", "engine_full", "wait_version", "weights",
                                                  "score", "encode", "send", "generate")},
        "loop_lag_ms": {"p50": _pct(lags, 50), "p99": _pct(lags, 99), "max": max(lags, default=None)}}
    hub: dict[str, float] = {}
    for e in inside:
        if e["track"] == "hub":
            hub[e["name"]] = hub.get(e["name"], 0.0) + e["dur"] / 1e6
    out["hub"] = {k: round(v, 4) for k, v in sorted(hub.items())}
    last = steady[-1]["args"]["step"]
    pairs = [(r, wall) for r, wall in timed(read_jsonl(Path(run_dir) / "metrics.jsonl")) if skip <= r["step"] <= last]
    out["metrics"] = dict(sorted(totals([r for r, _ in pairs], ("gen/", "time/hub/")).items()))
    bound = verdict(pairs, _trains_adapters(Path(run_dir)))
    out["verdict"] = {**bound.fields(), "sentence": bound.line()} if bound else None
    # the held-out pass@1 of each evaluation round (eval.every): accuracy beside the speed of the same run
    rounds = sorted(read_jsonl(Path(run_dir) / "eval.jsonl"), key=lambda e: e["version"])
    out["heldout_pass@1"] = {str(e["version"]): round(e["eval/pass@1"], 4) for e in rounds}
    return out


def while_generating(steps: list[dict], generate: list[dict]) -> list[dict]:
    """The steps that ended before the engines' last group did: a run's last steps (up to k of them) train batches
    generated ahead, with nothing generating beside them. They trained a GPU-bound colocated run's step in 3 s
    against 5 s, and would count a generation-bound run's buffered batches as a rate; 12-step runs counted 1-2 of
    them, 5-9 % over the steady rate (docs/figures.md, "a short run's tail"). All of `steps` where fewer than two
    are left."""
    if not generate:
        return steps
    done = max(e["ts"] + e["dur"] for e in generate)
    live = [e for e in steps if e["ts"] + e["dur"] <= done]
    return live if len(live) >= 2 else steps


def startup(spans: list[dict], launched: float | None = None) -> list[dict]:
    """The start's phases, in the order they began: [{"phase", "from_launch_s", "s"}]."""
    origin = launched if launched else min(e["ts"] for e in spans) / 1e6
    phases = [(f'{e["track"]}: {e["name"]}', e) for e in spans if e["track"] in ("startup", "engine")]
    for name, track in (("generate", None), ("wait", "learner"), ("train", "learner")):
        first = min((e for e in spans if e["name"] == name and (track is None or e["track"] == track)),
                    key=lambda e: e["ts"], default=None)
        if first is not None:
            phases.append((f"first {name}", first))
    return [{"phase": label, "from_launch_s": round(e["ts"] / 1e6 - origin, 2), "s": round(e["dur"] / 1e6, 2)}
            for label, e in sorted(phases, key=lambda p: p[1]["ts"])]


def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of the intervals, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def _stats(xs: list[float]) -> dict:
    return {"n": len(xs), "median": _median(xs), "total": sum(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--launched", type=float, default=None, help="time.time() at launch")
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--plot", nargs=3, metavar=("FIRST", "LAST", "PNG"), help="draw steps FIRST..LAST into PNG")
    p.add_argument("--waits", action="store_true", help="what each steady step that waited waited for")
    p.add_argument("--least", type=float, default=0.05, help="--waits: the shortest wait shown, in seconds")
    a = p.parse_args()
    if a.waits:
        print(json.dumps(waits(a.run_dir, a.skip, a.least), indent=1))
        return
    if a.plot:
        print(plot(a.run_dir, int(a.plot[0]), int(a.plot[1]), Path(a.plot[2])))
        return
    print(json.dumps(summary(a.run_dir, a.launched, a.skip), indent=1))


def _trains_adapters(run_dir: Path) -> bool:
    """Whether the run's config.yaml sets model.lora (the verdict then leaves it out of the learner's knobs)."""
    from pipeline.config import load_config

    config = run_dir / "config.yaml"
    return config.exists() and load_config(config).model.lora is not None


def plot(run_dir: Path, first: int, last: int, out: Path, lanes: int = 12) -> Path:
    """A picture of steps first..last from RUN_DIR/trace.json: the learner's phases, the generator's leases, waits
    and weights loads, and its first `lanes` group lanes (generate, score, encode, send), against seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = trace.spans(trace.read(Path(run_dir) / "trace.json"))
    steps = [e for e in spans if e["track"] == "learner" and e["name"] == "step" and first <= e["args"]["step"] <= last]
    t0, t1 = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    rows = ["learner", "leases", "weights"] + [f"group {i}" for i in range(lanes)]
    colours = {"wait": "#d62728", "train": "#2ca02c", "publish": "#9467bd", "record": "#8c564b",
               "checkpoint": "#7f7f7f",
               "lease": "#1f77b4", "wait_room": "#ff9896", "engine_full": "#c5b0d5", "wait_version": "#ffbb78",
               "weights": "#9467bd",
               "generate": "#17becf", "score": "#bcbd22", "encode": "#e377c2", "send": "#7f7f7f"}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.2))
    for y, row in enumerate(rows):
        for e in spans:
            if e["track"] == row and e["name"] in colours and e["ts"] < t1 and e["ts"] + e["dur"] > t0:
                ax.broken_barh([((e["ts"] - t0) / 1e6, max(e["dur"], 500) / 1e6)], (y - 0.4, 0.8),
                               color=colours[e["name"]])
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=n) for n, c in colours.items()], ncol=7, fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title(f"{Path(run_dir).name}: steps {first}-{last}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
