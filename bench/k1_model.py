"""k = 1 on one GPU, by a model, not a run: would holding a newer batch's groups back on an engine, while it still
generates groups of the batch the learner waits for, shorten the period?

    python -m bench.k1_model [--steps 150] [--seeds 3]

The twenty-first session weighed it (docs/figures.md, "What k = 1's waits wait for"): a straggler decodes about twice
as fast alone (a SmolLM2 engine's decode step is its host's time, about 2.0 ms + 0.0304 ms a sequence: 2.5 ms at 16,
5.9 ms at 128), but the next batch loses its head start. The model: E engines, each decoding its sequences one token
a step in continuous batches, the step `a + c x sequences` long, `f` times longer while the learner trains on the same
GPU (the engines' kernels take turns with its); a batch of G groups of `per` samples, each group's lengths exponential
around a mean of its own (lognormal about `mean`, `spread`), capped at `cap`; the learner trains step n once batch n
is in, for T s, and publishing takes `pub` s, after which the window lets batch n + k + 1 out, each engine taking its
share of its groups. `now` takes them at once (as the generators do); `hold` takes them on an engine only once it
generates nothing of an older batch. No tokens, no engine: only the decode step's cost and the window's rule.
"""

from __future__ import annotations

import argparse
import random
import statistics as st


def lengths(rng: random.Random, groups: int, per: int, mean: float, cap: int, spread: float) -> list[list[int]]:
    """Each group's completion lengths: exponential around a mean of the group's, lognormal about `mean`."""
    out = []
    for _ in range(groups):
        m = mean * rng.lognormvariate(-spread * spread / 2, spread)
        out.append([min(cap, 1 + int(rng.expovariate(1 / m))) for _ in range(per)])
    return out


def run(policy: str, steps: int = 150, engines: int = 2, T: float = 0.45, pub: float = 0.03, a: float = 2.0e-3,
        c: float = 0.0304e-3, f: float = 1.5, mean: float = 30, cap: int = 128, spread: float = 0.5, seed: int = 0,
        k: int = 1, G: int = 32, per: int = 8, skip: int = 10) -> tuple[float, float]:
    """(steps/min, the learner's share of time waiting) over steps skip..steps-1 under `policy` (`now`, `hold`)."""
    rng = random.Random(seed)
    batches = [lengths(rng, G, per, mean, cap, spread) for _ in range(steps + k + 2)]
    running: list[list[list[int]]] = [[] for _ in range(engines)]  # per engine: [tokens left, batch]
    pending: dict[int, list[list[int]]] = {}  # batch -> groups not yet taken
    share: dict[tuple[int, int], int] = {}  # (batch, engine) -> groups that engine may still take
    left: dict[int, int] = {}  # batch -> samples not yet ended
    avail: dict[int, float] = {}  # batch -> when the window lets it out
    done_at: dict[int, float] = {}  # batch -> when its last sample ended

    def release(b: int, when: float) -> None:
        pending[b], left[b], avail[b] = list(batches[b]), G * per, when
        for e in range(engines):
            share[(b, e)] = G // engines + (1 if e < G % engines else 0)

    for b in range(k + 1):
        release(b, 0.0)
    clock = [0.0] * engines
    learner_free, step, waited, starts = 0.0, 0, 0.0, []
    while step < steps:
        e = min(range(engines), key=lambda i: clock[i])
        now = clock[e]
        if step in done_at and done_at[step] <= now:  # the learner's next step, in time order with the engines
            begin = max(learner_free, done_at[step])
            if step >= skip:
                waited += begin - learner_free
            starts.append(begin)
            learner_free = begin + T + pub
            release(step + k + 1, learner_free)
            step += 1
            continue
        for b in sorted(pending):
            if avail[b] > now or not pending[b]:
                continue
            if policy == "hold" and any(r[1] < b for r in running[e]):
                continue
            n = min(len(pending[b]), share[(b, e)])
            for _ in range(n):
                running[e].extend([length, b] for length in pending[b].pop())
            share[(b, e)] -= n
        if not running[e]:
            clock[e] = min([avail[b] for b in pending if pending[b] and avail[b] > now] + [now + 1e-3])
            continue
        dt = a + c * len(running[e])
        if learner_free - T - pub <= now < learner_free - pub:
            dt *= f
        clock[e] = now + dt
        keep = []
        for r in running[e]:
            r[0] -= 1
            if r[0] > 0:
                keep.append(r)
                continue
            left[r[1]] -= 1
            if left[r[1]] == 0:
                done_at[r[1]] = now + dt
        running[e] = keep
    span = starts[-1] - starts[skip]
    return 60 * (len(starts) - 1 - skip) / span, waited / (span + T + pub)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print("| f (decode slowed beside training) | mean tokens | now: steps/min, wait | hold: steps/min, wait |")
    print("|---|---|---|---|")
    for f in (1.25, 1.5, 1.75, 2.0, 2.5):
        for mean in (24, 36):
            cells = []
            for policy in ("now", "hold"):
                r = [run(policy, steps=args.steps, f=f, mean=mean, seed=s) for s in range(args.seeds)]
                cells.append(f"{st.mean(x[0] for x in r):.1f}, {100 * st.mean(x[1] for x in r):.1f} %")
            print(f"| {f} | {mean} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
