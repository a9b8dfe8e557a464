"""GPU, one device: QLoRA on SmolLM2-135M-Instruct as a user starts it, `pipeline run -c configs/gpu-smollm2-math.yaml`
with model.lora and model.quantization 4bit added, in both generator.lora_mode's. The learner's base is NF4 on the GPU
(bitsandbytes), the engine serves that base dequantized (pipeline/quantization.py) and each version is the adapter
alone, over ipc (the engine shares the learner's GPU): at k = 0 the engine's log-probs are the learner's within bf16's
rounding, at every version. Prints each run's figures (mismatch, bytes, swap times, tokens/s, the learner's memory)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.gpu.helpers import run_to_end, smollm2_one_gpu_marks

pytestmark = smollm2_one_gpu_marks()
STEPS = 5
ROOT = Path(__file__).resolve().parents[2]
# bf16 on both sides, the same weights: the full-weight runs of this model measured 1.3e-3 to 2.4e-3 at lag 0 (docs/
# figures.md); serving the checkpoint's bf16 weights instead of the learner's 4-bit base adds the quantization error
KL_BOUND = 5e-3


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_qlora_on_smollm2_on_one_gpu(tmp_path: Path, mode: str) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline", "run", "-c", str(ROOT / "configs" / "gpu-smollm2-math.yaml"),
           "--run-dir", str(run_dir), "--set", "model.lora={r: 16, alpha: 32}", "--set", "model.quantization=4bit",
           "--set", f"generator.lora_mode={mode}", "--set", f"trainer.total_steps={STEPS}",
           "--set", "trainer.max_staleness=0", "--set", "eval.every=0",
           # start-up is not what is measured: no CUDA graphs, no compiled layers (both minutes on a fresh machine)
           "--set", "generator.enforce_eager=true", "--set", "trainer.compile=false"]
    rc = run_to_end(cmd, tmp_path / "run.log", ROOT, timeout=420)
    tail = (tmp_path / "run.log").read_text()[-3000:]
    assert rc == 0, tail
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    kl = [r.get("mismatch/kl_lag0") for r in records]
    keep = ("mismatch/kl_lag0", "sync/version_bytes", "learner/peak_gpu_gib", "tokens/completion_mean")
    figures = {"mode": mode, "records": [{k: v for k, v in r.items() if k in keep or k.startswith(("sync/", "time/",
                                                                                                    "throughput"))}
                                         for r in records]}
    print(json.dumps(figures))
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / f"qlora_{mode}.json", "w") as f:
            json.dump(figures, f)
    assert all(k is not None for k in kl) and max(kl) < KL_BOUND, kl
    shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]  # q k v o g u d
    adapter = 30 * sum(16 * (i + o) for i, o in shapes) * 2  # r (in + out) of each, 30 layers, bf16
    assert [r["sync/version_bytes"] for r in records] == [adapter] * STEPS  # the adapter alone
