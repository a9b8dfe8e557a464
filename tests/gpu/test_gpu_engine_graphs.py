"""GPU, one device: the engine's samples under each of its CUDA-graph settings are the learner's weights' samples.
SmolLM2-135M-Instruct as a user starts it (`pipeline run -c configs/gpu-smollm2-math.yaml`) at k = 1 with
generator.compile false (decode-only graphs, no compile) and as shipped: the engine's log-probs are the learner's at
every step, within bf16's rounding and one step's change of the weights (k = 1: most batches are of lag 1). vLLM
0.26's FULL mode, graphs of mixed batches too, broke this on an H200: a mismatch KL of 0.07-1.05 at 45 of 90 steps of
two runs, the first two steps among them, against 0.0008-0.0029 (docs/figures.md, "The engine without its compile")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.gpu.helpers import run_to_end, smollm2_one_gpu_marks

pytestmark = smollm2_one_gpu_marks()
STEPS = 12
ROOT = Path(__file__).resolve().parents[2]
KL_BOUND = 0.02  # measured 0.0008-0.0029 at lags 0 and 1 (lr 1e-5), and 0.07-1.05 where the graphs sampled wrong


@pytest.mark.parametrize("compile_", [False, True], ids=["decode-graphs", "compiled"])
def test_the_engines_samples_match_the_learner_at_every_step_with_and_without_its_compile(tmp_path: Path,
                                                                                          compile_: bool) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline", "run", "-c", str(ROOT / "configs" / "gpu-smollm2-math.yaml"),
           "--run-dir", str(run_dir), "--set", f"generator.compile={str(compile_).lower()}",
           "--set", f"trainer.total_steps={STEPS}", "--set", "trainer.max_staleness=1", "--set", "eval.every=0",
           "--set", "trainer.compile=false"]
    rc = run_to_end(cmd, tmp_path / "run.log", ROOT, timeout=420)
    assert rc == 0, (tmp_path / "run.log").read_text()[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    kl = [r["mismatch/kl"] for r in records]
    assert max(kl) < KL_BOUND, kl
