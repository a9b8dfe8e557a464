"""Per-step metrics: one JSON record per learner step in RUN_DIR/metrics.jsonl, a log line, a plot."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from pipeline.staleness import behaviour_version

log = logging.getLogger(__name__)


class MetricsWriter:
    """metrics.jsonl always; TensorBoard scalars (run.tensorboard) and Weights & Biases (run.wandb_project) for the
    numbers of each record, when their packages are installed (else one warning)."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb_project: str | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError as e:
                log.warning("run.tensorboard: no TensorBoard writer (%s); metrics.jsonl only", e)
        if wandb_project:
            try:
                import wandb

                self.wandb = wandb.init(project=wandb_project, name=run_dir.name, dir=str(run_dir))
            except ImportError:
                log.warning("run.wandb_project: wandb is not installed (pip install wandb); metrics.jsonl only")

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info(
            "step %d | reward %.3f | lag max %d | wait %.2f s | step %.2f s | sync %.0f ms | %.0f tok/s",
            record["step"], record["reward/mean"], record["staleness/max_lag"], record["time/wait_s"],
            record["time/step_s"], record["sync/weights_ms"], record["throughput/tokens_per_s"],
        )
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def step_record(step: int, stats: dict, *, sync_ms: float, elapsed_s: float, publisher: dict, tokens_per_s: float,
                generators: int, max_staleness: int, groups: list, counters: dict, evaluations: list[dict],
                on_learner_gpus: int = 0, mps: bool = False) -> dict:
    """One learner step's metrics.jsonl record: its version, its stats and phases (`stats`), the weights' sync, the
    throughput, the generators registered (and of them, those on a learner rank's GPU; `mps`: the learner is a CUDA MPS
    client, pipeline/mps.py), the groups it trained
    (epoch, prompt, behaviour version, generator), the hub's counters (hub/...) and the evaluation rounds finished
    since the last record (eval/...; all of them are in eval.jsonl)."""
    record = {
        "step": step, "version": step + 1, **stats, "sync/weights_ms": sync_ms, "time/elapsed_s": elapsed_s,
        **publisher, "throughput/tokens_per_s": tokens_per_s, "generators": generators,
        "generators_on_learner_gpus": on_learner_gpus, "mps": mps, "max_staleness": max_staleness,
        "trained": [[g.epoch, g.prompt_id, behaviour_version(g), g.generator_id] for g in groups],
        "groups_by_generator": dict(Counter(g.generator_id for g in groups)),
        **{f"hub/{k}": v for k, v in counters.items()},
    }
    for done in evaluations:
        record.update({"eval/version": done["version"], **{k: v for k, v in done.items() if k.startswith("eval/")}})
    return record


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (metrics, events, changes); none while it does not exist yet. Every record
    ends with its newline: a last line without one is a record still being written (a reader beside the writer) or
    one its writer did not finish (killed while writing), left out."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    whole = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def truncate_metrics(run_dir: Path, version: int) -> int:
    """On resume from `version`: keep the records of steps < version; move later ones (their weights were
    lost with the learner) to metrics.discarded.jsonl. Returns how many were moved."""
    records = read_metrics(run_dir)
    keep = [r for r in records if r["step"] < version]
    gone = [r for r in records if r["step"] >= version]
    if gone:
        with (Path(run_dir) / "metrics.discarded.jsonl").open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in gone)
        (Path(run_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
    return len(gone)


def eval_version(record: dict) -> int:
    """The version an evaluation round's accuracy belongs to, at the latest: the newest that sampled it. At a large k
    the round labelled v takes the engines' room that training leaves and is sampled by later weights
    (hub/evaluation.py: eval/newest_version)."""
    return max(record["version"], record.get("eval/newest_version", record["version"]))


def plot(run_dir: Path) -> Path | None:
    """reward.png: mean reward (and the held-out reward of eval.every) and staleness (max/mean lag) against step."""
    records = read_metrics(run_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(steps, [r["reward/mean"] for r in records], marker=".", label="mean reward")
    evals = read_jsonl(Path(run_dir) / "eval.jsonl")  # eval.every: held-out reward, after its version's step
    if evals:
        ax1.plot([eval_version(e) - 1 for e in evals],
                 [e["eval/reward_mean"] for e in evals], marker="s", label="held-out reward (eval)")
    ax1.set_ylabel("reward")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(steps, [r["staleness/max_lag"] for r in records], marker=".", label="max lag")
    ax2.plot(steps, [r["staleness/mean_lag"] for r in records], marker=".", label="mean lag")
    ax2.set_ylabel("staleness (versions)")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / "reward.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
