"""bench/run_gpu.sh mps, its `low` runs: under CUDA MPS, the learner's context below normal priority
(CUDA_MPS_CLIENT_PRIORITY 1, read when the context is made) and the engines' at normal, so that the engines' decode
kernels go first on the GPU they share. On PYTHONPATH for those runs only: every Python process of the run imports it,
and it acts in the learner's alone (`python -m pipeline learner ...`, whose children inherit it)."""

import os
import sys

with open("/proc/self/cmdline", "rb") as f:
    _args = f.read().split(b"\0")
if b"pipeline" in _args and b"learner" in _args:
    os.environ["CUDA_MPS_CLIENT_PRIORITY"] = "1"
    print("bench/mps_low: CUDA_MPS_CLIENT_PRIORITY=1 in the learner", file=sys.stderr, flush=True)
