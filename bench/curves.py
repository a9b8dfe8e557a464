"""Held-out accuracy curves of `pipeline run` directories, for bench.learning_curves and bench.vs_trl: each
evaluation round of RUN_DIR/eval.jsonl placed in steps and in wall time, the time a curve first reaches a target,
what a step's health records say (mismatch KL, importance weights), and where a step's time goes; over seeds, a
cell's summary of them (mean and 95 % t-interval) and its plot.

Wall time of version v: when the learner logged the record of the step that made it (RUN_DIR/logs/learner.log,
"step v-1 | ..."), from the launch the benchmark recorded (`launched_at`, unix seconds), so engine start and model
load count as a user waits for them; `elapsed_s` is the learner's own clock (time/elapsed_s, from its first
step's start). Version 0 is at the learner's first step's start. An evaluation round stands at the time of the
newest weights that sampled it (eval/newest_version): at a large k a round labelled v takes turns with training
leases and may be sampled by v + 9 ... v + 19, and its accuracy is theirs, known no earlier.
"""

from __future__ import annotations

import datetime
import math
import statistics
from pathlib import Path

from pipeline.metrics import eval_version, read_jsonl

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided, by dof


def step_stamps(run_dir: Path) -> dict[int, float]:
    """Unix time of each step's record, {version: time}, from the learner's log lines "step N | ..."."""
    path = Path(run_dir) / "logs" / "learner.log"
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        head, sep, rest = line.partition("pipeline.metrics: step ")
        if not sep:
            continue
        try:
            stamp = datetime.datetime.strptime(head[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out[int(rest.split(" ", 1)[0]) + 1] = stamp
        except ValueError:
            continue
    return out


def eval_curve(run_dir: Path, launched_at: float | None = None) -> list[dict]:
    """One point per evaluation round: version, eval/pass@1, eval/reward_mean, elapsed_s and wall_s (None where
    unknown), and the versions that sampled it (behaviour_version, newest_version: a round that took turns with
    training leases at a large k may be sampled after its version's weights were gone, hub/evaluation.py). Its
    times are the newest version's: the accuracy is not reached before the weights that showed it existed."""
    run_dir = Path(run_dir)
    elapsed = {r["version"]: r["time/elapsed_s"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    stamps = step_stamps(run_dir)
    known = [v for v in stamps if v in elapsed]
    start = stamps[known[0]] - elapsed[known[0]] if known else None  # the learner's first step's start
    points = []
    for e in sorted(read_jsonl(run_dir / "eval.jsonl"), key=lambda e: e["version"]):
        v = e["version"]
        newest = eval_version(e)  # the weights the round's accuracy belongs to, at the latest
        at = start if newest == 0 else stamps.get(newest)
        points.append({"version": v, "pass@1": round(e["eval/pass@1"], 4),
                       "reward_mean": round(e["eval/reward_mean"], 4),
                       "behaviour_version": e.get("eval/behaviour_version", v), "newest_version": newest,
                       "elapsed_s": 0.0 if newest == 0 else _round(elapsed.get(newest)),
                       "wall_s": _round(at - launched_at) if at is not None and launched_at else None})
    return points


def final(points: list[dict], window: int = 1) -> float | None:
    """The held-out accuracy a curve ends at: the mean pass@1 of its last `window` rounds."""
    tail = [p["pass@1"] for p in points[-window:]]
    return statistics.mean(tail) if tail else None


def reach(points: list[dict], target: float | None, window: int = 1) -> dict | None:
    """The first round whose pass@1 (mean of it and the `window` - 1 rounds before) reaches `target`: that point,
    or None."""
    if target is None:
        return None
    for i, p in enumerate(points):
        if statistics.mean(q["pass@1"] for q in points[max(0, i - window + 1):i + 1]) >= target - 1e-12:
            return p
    return None


def mean_curve(curves: list[list[dict]]) -> list[dict]:
    """Point by point over seeds, at the versions every curve has: mean pass@1 and mean times."""
    common = set.intersection(*({p["version"] for p in c} for c in curves)) if curves else set()
    out = []
    for v in sorted(common):
        at = [next(p for p in c if p["version"] == v) for c in curves]
        out.append({"version": v, **{k: _mean([p[k] for p in at]) for k in ("pass@1", "reward_mean", "elapsed_s",
                                                                            "wall_s")}})
    return out


def health(records: list[dict]) -> dict:
    """The train-inference mismatch and the importance weights over a run's steps that trained tokens (learner/
    health.py): KL (k3) overall and by lag, weight percentiles (each step's, averaged; max: the largest), what the
    loss applied and clipped, the entropy at start and end."""
    rs = [r for r in records if r.get("tokens/trained", 1) > 0 and "mismatch/kl" in r]
    if not rs:
        return {}
    lags = sorted({int(k.rsplit("lag", 1)[1]) for r in rs for k in r if k.startswith("mismatch/kl_lag")})
    out = {
        "steps": len(rs), "mismatch_kl": _mean([r["mismatch/kl"] for r in rs]),
        "mismatch_kl_by_lag": {str(j): _mean([r[f"mismatch/kl_lag{j}"] for r in rs if f"mismatch/kl_lag{j}" in r])
                               for j in lags},
        "is_weight": {"mean": _mean([r["correction/is_weight_mean"] for r in rs]),
                      **{q: _mean([r[f"correction/is_weight_{q}"] for r in rs]) for q in ("p50", "p90", "p99")},
                      "max": max(r["correction/is_weight_max"] for r in rs)},
        "weight_applied_mean": _mean([r["correction/weight_mean"] for r in rs]),
        "clip_frac": _mean([r["correction/clip_frac"] for r in rs]),
        "token_masked": _mean([r["correction/token_masked"] for r in rs]),
        "entropy_first_last": [_mean([r["entropy/mean"] for r in rs[:10]]),
                               _mean([r["entropy/mean"] for r in rs[-10:]])],
    }
    return out


def step_breakdown(records: list[dict], events: list[dict] | None = None, skip: int = 2,
                   samples_per_step: int | None = None, engine_tokens_per_s: float | None = None) -> dict:
    """Where a step's time goes, medians over the steps after the first `skip` (engine start, first compile): the
    period between two step records, the learner's wait for a batch, its training step, its publish of the new
    weights, the rest of its loop (metrics, the hub's bookkeeping, checkpoints); the generators' weight load (the
    events' load_ms); completion tokens per step; with `engine_tokens_per_s` (the engine alone, measured apart), the
    seconds the engine alone would need for a step's tokens. Not timed apart by the run: the hub's handling of
    rollouts, reward scoring and tokenising (in the generators' and the hub's threads, inside the learner's wait)."""
    rs = records[skip:]
    if len(rs) < 2:
        return {}
    periods = [b["time/elapsed_s"] - a["time/elapsed_s"] for a, b in zip(rs, rs[1:], strict=False)]
    wait = [r["time/wait_s"] for r in rs[1:]]
    train = [r["time/step_s"] for r in rs[1:]]
    early = [r.get("time/early_s", 0.0) for r in rs[1:]]  # inside the wait, not in time/wait_s (learner/early.py)
    publish = [r["sync/weights_ms"] / 1000 for r in rs[1:]]
    rest = [p - w - e - t - s for p, w, e, t, s in zip(periods, wait, early, train, publish, strict=True)]
    out = {"steps": len(periods), "period_s": _median(periods), "wait_s": _median(wait), "train_s": _median(train),
           "publish_s": _median(publish), "learner_rest_s": _median(rest),
           "steps_per_min": 60 / _median(periods) if _median(periods) else None}
    if any(early):
        out["early_s"] = _median(early)
    loads = [e["load_ms"] / 1000 for e in events or [] if e.get("event") == "weights_applied" and e.get("version")]
    if loads:
        out["generator_weight_load_s"] = _median(loads)
    if samples_per_step:
        tokens = [r["tokens/completion_mean"] * samples_per_step for r in rs[1:] if "tokens/completion_mean" in r]
        out["completion_tokens_per_step"] = _median(tokens)
        if engine_tokens_per_s and tokens:
            engine = _median(tokens) / engine_tokens_per_s
            out["engine_alone_s"] = engine
            out["beyond_engine_s"] = out["period_s"] - engine  # at k = 0: the loop's own time (train, sync, hub)
    return out


def interval(values: list[float]) -> dict:
    """Mean and the half-width of its 95 % t-interval."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "ci95": None, "n": 0}
    mean = statistics.mean(values)
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 \
        else None
    return {"mean": float(f"{mean:.4g}"), "ci95": float(f"{half:.4g}") if half is not None else None, "n": len(values)}


def cell_health(seeds: list[dict]) -> dict:
    """A cell's train-inference mismatch and importance weights (bench/py `health`) over its seeds."""
    hs = [r["health"] for r in seeds if r.get("health")]
    lags = sorted({j for h in hs for j in h["mismatch_kl_by_lag"]}, key=int)
    return {"mismatch_kl": interval([h["mismatch_kl"] for h in hs]),
            "mismatch_kl_by_lag": {j: interval([h["mismatch_kl_by_lag"].get(j) for h in hs]) for j in lags},
            "is_weight": {q: interval([h["is_weight"][q] for h in hs]) for q in ("mean", "p50", "p90", "p99")}
            | {"max": max(h["is_weight"]["max"] for h in hs)},
            "weight_applied_mean": interval([h["weight_applied_mean"] for h in hs]),
            "clip_frac": interval([h["clip_frac"] for h in hs])}


def cell_heldout(seeds: dict[str, dict], sync: dict[str, dict], window: int) -> dict:
    """Held-out accuracy of one cell over its seeds: initial and final pass@1, and the time to target, the first
    round at which each seed reaches the final held-out accuracy of the same seed's k = 0 run of its loss (steps;
    seconds from launch and on the learner's clock; the fraction of k = 0's whole run from launch). A seed that
    never reaches it counts in `reached` only."""
    hits = []
    for seed, r in seeds.items():
        if seed not in sync or not r.get("curve") or not sync[seed].get("curve"):
            continue
        target, ref = final(sync[seed]["curve"], window), sync[seed]["curve"]
        hit = reach(r["curve"], target, window)
        hits.append({"target": target, "version": hit and hit["version"], "wall_s": hit and hit["wall_s"],
                     "elapsed_s": hit and hit["elapsed_s"],
                     "of_k0_wall": hit["wall_s"] / ref[-1]["wall_s"] if hit and hit["wall_s"] and ref[-1]["wall_s"]
                     else None})
    reached = [h for h in hits if h["version"] is not None]
    k0_mean = mean_curve([r["curve"] for r in sync.values() if r.get("curve")])
    mean = mean_curve([r["curve"] for r in seeds.values() if r.get("curve")])
    hit = reach(mean, final(k0_mean, window), window) if k0_mean else None
    return {
        "initial": interval([r["curve"][0]["pass@1"] if r.get("curve") else None for r in seeds.values()]),
        "final": interval([final(r["curve"], window) for r in seeds.values() if r.get("curve")]),
        "target": interval([h["target"] for h in hits]), "reached": f"{len(reached)}/{len(hits)}",
        "steps_to_target": interval([h["version"] for h in reached]),
        "wall_to_target_s": interval([h["wall_s"] for h in reached]),
        "elapsed_to_target_s": interval([h["elapsed_s"] for h in reached]),
        "of_k0_wall": interval([h["of_k0_wall"] for h in reached]),
        "mean_curves": {"target": final(k0_mean, window) if k0_mean else None, "at": hit},
    }


def best_k(summary: dict) -> dict:
    """Per loss, the k >= 1 whose seeds all reached k = 0's final held-out accuracy in the least wall time from
    launch (mean over seeds), beside k = 0's own time to it."""
    out = {}
    for key, cell in summary.items():
        k, loss = key.split("/")
        h = cell.get("heldout")
        if not h or k == "k0" or h["reached"].split("/")[0] != h["reached"].split("/")[1] or h["reached"] == "0/0":
            continue
        if loss not in out or h["wall_to_target_s"]["mean"] < out[loss]["wall_to_target_s"]["mean"]:
            out[loss] = {"k": int(k[1:]), "wall_to_target_s": h["wall_to_target_s"], "of_k0_wall": h["of_k0_wall"],
                         "k0_wall_to_target_s": summary.get(f"k0/{loss}", {}).get("heldout", {}).get(
                             "wall_to_target_s")}
    return out


def plot_heldout(runs: dict, losses: list[str], ks: list[int], path: Path) -> None:
    """Held-out accuracy (eval/pass@1, mean over seeds) against steps and against wall time from launch, a column
    per loss, a color per k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(losses), figsize=(4 * len(losses), 7), squeeze=False, sharey=True)
    for col, loss in enumerate(losses):
        for k in ks:
            seeds = [r["curve"] for name, r in runs.items() if name.startswith(f"k{k}/{loss}/") and r.get("curve")]
            mean = mean_curve(seeds)
            if not mean:
                continue
            color = f"C{ks.index(k)}"
            axes[0][col].plot([p["version"] for p in mean], [p["pass@1"] for p in mean], label=f"k={k}", color=color,
                              marker=".")
            timed = [p for p in mean if p["wall_s"] is not None]
            axes[1][col].plot([p["wall_s"] for p in timed], [p["pass@1"] for p in timed], color=color, marker=".")
        axes[0][col].set_title(loss)
        axes[0][col].set_xlabel("step (weights version)")
        axes[1][col].set_xlabel("wall time from launch (s)")
        for row in axes:
            row[col].grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out pass@1 (mean over seeds)")
    axes[1][0].set_ylabel("held-out pass@1")
    axes[0][0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(f"{statistics.mean(xs):.4g}") if xs else None


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(f"{statistics.median(xs):.4g}") if xs else None


def _round(x: float | None) -> float | None:
    return round(x, 2) if x is not None else None
