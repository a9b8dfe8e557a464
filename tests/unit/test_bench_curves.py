"""bench/curves.py places an evaluation round at the time of the newest weights that sampled it: at a large k the
round labelled v0 takes turns with training leases and is sampled by later versions, so its accuracy is theirs and
a time-to-accuracy must not count it from the learner's first step (a session once reported 0.10x of TRL so)."""

import datetime
import json

from bench.curves import eval_curve, reach

LAUNCH = 1_800_000_000.0


def write_run(run, rounds):
    """A run directory: the learner's step lines at LAUNCH + 20 + 2 v, its metrics (elapsed from its start at
    LAUNCH + 18), and the given eval.jsonl records."""
    (run / "logs").mkdir(parents=True)
    lines, metrics = [], []
    for step in range(30):
        t = LAUNCH + 20 + 2 * (step + 1)  # the record of step N makes version N + 1
        stamp = datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:23]
        lines.append(f"{stamp} INFO pipeline.metrics: step {step} | loss 0.1")
        metrics.append({"version": step + 1, "time/elapsed_s": t - (LAUNCH + 18)})
    (run / "logs" / "learner.log").write_text("\n".join(lines) + "\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))


def round_(version, pass1, behaviour, newest):
    return {"version": version, "eval/pass@1": pass1, "eval/reward_mean": pass1,
            "eval/behaviour_version": behaviour, "eval/newest_version": newest}


def test_a_round_sampled_by_later_weights_stands_at_the_newest_of_them(tmp_path):
    write_run(tmp_path, [round_(0, 0.22, 9, 19), round_(10, 0.42, 10, 10)])
    points = eval_curve(tmp_path, launched_at=LAUNCH)
    assert [p["newest_version"] for p in points] == [19, 10]
    assert points[0]["wall_s"] == 20 + 2 * 19  # version 19's step record, not the learner's start (18 s)
    assert points[0]["elapsed_s"] == 2 + 2 * 19
    assert points[1]["wall_s"] == 20 + 2 * 10
    assert reach(points, 0.2)["wall_s"] == 58


def test_a_round_of_its_own_version_stands_at_that_version(tmp_path):
    write_run(tmp_path, [round_(0, 0.15, 0, 0), round_(10, 0.40, 10, 10)])
    points = eval_curve(tmp_path, launched_at=LAUNCH)
    assert points[0]["wall_s"] == 18 and points[0]["elapsed_s"] == 0.0  # version 0: the learner's start
    assert points[1]["wall_s"] == 40


def test_a_cells_final_held_out_accuracy_is_its_newest_rounds_whichever_ended_last():
    """Rounds end out of order: an overdue v140 round can end after v150's. The grid's summary once took the round
    that ended last, and reported three k = 8 runs "at v140" that had their v150 round."""
    from bench.learning_curves import summarise

    def run(evals):
        return {"rewards": [0.5] * 10, "elapsed_s": [float(i) for i in range(10)], "lags": {"0": 10}, "max_lag": 0,
                "steps_to_threshold": None, "auc": 0.5, "final": 0.5, "eval": evals, "mismatch_kl_lag0": None,
                "wall_to_threshold_s": None, "k": 0}

    runs = {"k0/m2po/s0": run([[130, 0.66], [150, 0.68], [140, 0.70]]),
            "k0/m2po/s1": run([[130, 0.64], [140, 0.66], [150, 0.70]])}
    assert summarise(runs, 150)["k0/m2po"]["eval_final"]["mean"] == 0.69


def test_a_runs_held_out_series_is_its_pass_at_1_not_a_reward_with_partial_credit(tmp_path):
    """reasoning-gym's score_answer gives part of a point to an answer near the right one, so a round's mean reward is
    above its accuracy: the grid read eval/reward_mean, and a k = 8 run of basic_arithmetic showed 94.6 % held out
    where 92.4 % of its answers were right (2026-11-30)."""
    from bench.learning_curves import summarise_run

    run = tmp_path / "k8" / "run"
    write_run(run, [round_(0, 0.09, 0, 0) | {"eval/reward_mean": 0.10},
                    round_(10, 0.9238, 10, 10) | {"eval/reward_mean": 0.9460}])
    step = {"reward/mean": 0.5, "trained": [], "time/wait_s": 0.1, "time/step_s": 1.0, "sync/weights_ms": 5.0,
            "tokens/completion_mean": 9.0}
    rows = [step | {"step": s, "version": s + 1, "time/elapsed_s": 2.0 * s} for s in range(10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarise_run(tmp_path / "k8", 8, 0.3, LAUNCH)["eval"] == [[0, 0.09], [10, 0.9238]]


def test_a_steps_breakdown_counts_what_the_learner_computed_while_it_waited_apart_from_the_rest():
    """time/early_s is inside the wait and not in time/wait_s (learner/timeline.py): the breakdown names it, and the
    learner's rest (the period less its parts) does not take it in."""
    from bench.curves import step_breakdown

    rows = [{"time/elapsed_s": 2.0 * s, "time/wait_s": 0.5, "time/early_s": 0.3, "time/step_s": 1.0,
             "sync/weights_ms": 100.0} for s in range(6)]
    out = step_breakdown(rows)
    assert out["early_s"] == 0.3 and abs(out["learner_rest_s"] - 0.1) < 1e-9
    assert "early_s" not in step_breakdown([{k: v for k, v in r.items() if k != "time/early_s"} for r in rows])
