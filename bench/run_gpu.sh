#!/usr/bin/env bash
# The whole GPU benchmark pass on a machine with 2 GPUs (learner GPU 0, generator GPU 1), in two parts
# so that each fits one 10-minute device call:
#   bash bench/run_gpu.sh part1   model build, generator_overhead, pipeline_speedup, GPU tests
#   bash bench/run_gpu.sh part2   weight_sync (0.5B, then 1.5B), join_latency
# Results: bench/results/*.json; logs and run directories are packed into $OUT (or bench/out).
# Expects vLLM 0.26 + DeepSpeed in /tmp/site (../shared/gpu-kit), or installed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_PGIDS=/tmp/bench-pgids.txt
OUT=${OUT:-bench/out}
mkdir -p "$OUT" bench/results /tmp/bench-logs
T0=$(date +%s)
# GPU processes left by an earlier, interrupted pass on this machine (our own; stopped by pid)
for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done; sleep 2

cleanup() {  # process groups the benchmarks started (each child runs in its own session)
  [ -f "$BENCH_PGIDS" ] || return 0
  while read -r pg; do kill -9 -- "-$pg" 2>/dev/null; done <"$BENCH_PGIDS"
  rm -f "$BENCH_PGIDS"
}
step() {  # step NAME SECONDS CMD...: run with a time limit, log to /tmp/bench-logs/NAME.log
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s, t=$(( $(date +%s) - T0 ))s)"
  timeout -k 15 "$secs" "$@" >"/tmp/bench-logs/$name.log" 2>&1
  echo "=== $name rc=$? ($(( $(date +%s) - T0 ))s)"
  tail -n 15 "/tmp/bench-logs/$name.log"
  cleanup
}
pack() {
  cp -r bench/results /tmp/bench-logs/ 2>/dev/null
  tar czf "$OUT/$1.tgz" -C /tmp bench-logs $(cd /tmp && ls -d bench-runs 2>/dev/null) \
    --exclude='*.safetensors' --exclude='*/checkpoint*' --exclude='*/final' 2>/dev/null
  cp bench/results/*.json "$OUT/" 2>/dev/null
  nvidia-smi >"$OUT/nvidia-smi-$1.txt" 2>&1
}

case "${1:-part1}" in
part1)
  nvidia-smi --query-gpu=index,name,memory.used --format=csv
  step build 120 python3 -c "from bench.common import build_model as b; b('0.5b', '/tmp/bench-models/q-0.5b')"
  step generator_overhead 130 python3 -m bench.generator_overhead --gpus 1
  step pipeline_speedup 230 python3 -m bench.pipeline_speedup --timeout 200 --steps 5 --transport nccl
  step pytest_gpu 150 python3 -m pytest -x -q tests/gpu -m gpu -p no:cacheprovider
  pack part1
  ;;
part2)
  step weight_sync 240 python3 -m bench.weight_sync --sizes 0.5b --transports nccl,shm,zmq
  step join_latency 150 python3 -m bench.join_latency
  left=$(( 440 - ($(date +%s) - T0) ))
  [ "$left" -gt 120 ] && step weight_sync_1.5b "$left" python3 -m bench.weight_sync --sizes 1.5b --name weight_sync_1.5b
  pack part2
  ;;
esac
echo "done in $(( $(date +%s) - T0 ))s"
