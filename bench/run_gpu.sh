#!/usr/bin/env bash
# The whole GPU benchmark pass on a machine with 4 GPUs (learner GPU 0, generators on 1..3), in
# parts that each fit one 10-minute device call (results are packed after every step):
#   bash bench/run_gpu.sh A   model build, weight_sync over nccl (0.5B) staged and not, the GPU tests (2, 3, 4 GPUs)
#   bash bench/run_gpu.sh B   pipeline_speedup (nccl), generator_scaling (1, 2, 3 GPUs)
#   bash bench/run_gpu.sh C   join_latency, weight_sync nccl (1.5B) and shm/zmq (0.5B), generator_overhead, colocated
#   bash bench/run_gpu.sh D   pipeline_speedup and generator_scaling only, shorter (a pass's last minutes)
#   bash bench/run_gpu.sh E   the 7B shape: weight_sync over nccl, learner ZeRO-3 on GPUs 0,1, generator on GPU 2
#   bash bench/run_gpu.sh G   pipeline_speedup (k=0, 1) and generator_overhead with CUDA graphs (0.5B, 1.5B)
#   bash bench/run_gpu.sh H   the GPU tests, then pipeline_speedup with 2 generators sharing the generator GPU
#   bash bench/run_gpu.sh I   pipeline_speedup with 3 generators on the generator GPU, weight_sync nccl (0.5B)
#   bash bench/run_gpu.sh J   the receiver thread: GPU tests, weight_sync nccl (0.5B), pipeline_speedup 2 engines again
#   bash bench/run_gpu.sh K   weight_sync nccl (1.5B), pipeline_speedup with 3 engines
#   bash bench/run_gpu.sh L   pipeline_speedup with 4 engines on the generator GPU, longer prompts (balance)
#   bash bench/run_gpu.sh M   4 GPUs: model build, all three GPU tests (the tensor-parallel joiner on the receiver thread)
#   bash bench/run_gpu.sh N   4 GPUs: generator_scaling (1, 2, 3 GPUs) with 60 s windows
#   bash bench/run_gpu.sh O   4 GPUs: weight_sync 7B (ZeRO-3 on 0,1) and 1.5B with in-flight CPU copies up to half the free memory
#   bash bench/run_gpu.sh P   4 GPUs: zero3_gather 7B (per parameter vs groups) and weight_sync 7B with grouped gathers
#   bash bench/run_gpu.sh Q   4 GPUs: model build, the GPU tests, zero3_gather 7B with the publisher's CPU copy (profiled)
#   bash bench/run_gpu.sh R   pipeline_speedup with 4 engines again: generators that drain while the learner publishes
#   bash bench/run_gpu.sh S   4 GPUs: zero3_gather 7B with the CPU copies started after the gathers, then the GPU tests
#   bash bench/run_gpu.sh single   on a one-GPU machine: `pipeline run -c configs/gpu-single.yaml`, colocated
# With 2 GPUs: A, B and G run all but the 4-GPU test and generator_scaling beyond 1 GPU.
# Results: bench/results/*.json; logs and run records (no weights) are packed into $OUT/part-X.tgz.
# Expects vLLM 0.26 + DeepSpeed in /tmp/site (../shared/gpu-kit), or installed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_PGIDS=/tmp/bench-pgids.txt BENCH_RESULTS=/tmp/bench-logs/results  # the tree is re-sent each call
OUT=${OUT:-bench/out}
mkdir -p "$OUT" /tmp/bench-logs/results
T0=$(date +%s)
cleanup() {  # process groups the benchmarks started (each child runs in its own session)
  [ -f "$BENCH_PGIDS" ] || return 0
  while read -r pg; do kill -9 -- "-$pg" 2>/dev/null; done <"$BENCH_PGIDS"
  rm -f "$BENCH_PGIDS"
}
cleanup  # what an earlier, interrupted pass of ours left (recorded by pid); never other processes on the GPUs
step() {  # step NAME SECONDS CMD...: run with a time limit, log to /tmp/bench-logs/NAME.log
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s, t=$(( $(date +%s) - T0 ))s)"
  timeout -k 15 "$secs" "$@" >"/tmp/bench-logs/$name.log" 2>&1
  echo "=== $name rc=$? ($(( $(date +%s) - T0 ))s)"
  tail -n 15 "/tmp/bench-logs/$name.log"
  cleanup
}
pack() {  # results, logs and run records (no weights, checkpoints or datasets) into one small archive
  (cd /tmp && find bench-logs bench-runs -type f \( -name '*.log' -o -name '*.json' -o -name 'metrics.jsonl' \
     -o -name 'events.jsonl' -o -name '*.yaml' \) -size -4M 2>/dev/null | tar czf "$OUT/part-$PART.tgz" -T -)
}
PART=${1:-A}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
nvidia-smi --query-gpu=index,name,memory.used --format=csv >"$OUT/nvidia-smi-$PART.txt" 2>&1

case "$PART" in
A)
  step build 120 python3 -c "from bench.common import build_model as b; b('0.5b', '/tmp/bench-models/q-0.5b')"
  step weight_sync 200 python3 -m bench.weight_sync --sizes 0.5b --transports nccl,nccl:unstaged; pack
  step pytest_gpu 400 python3 -m pytest -q -rs tests/gpu -m gpu -p no:cacheprovider; pack
  ;;
B)
  step pipeline_speedup 200 python3 -m bench.pipeline_speedup --timeout 180 --steps 4 --transport nccl; pack
  scale=$( [ "$GPUS" -ge 4 ] && echo 1,2,3 || echo 1 )
  step generator_scaling 330 python3 -m bench.generator_scaling --gpus "$scale" --window 60; pack
  ;;
D)  # the two re-runs after the pass of 2026-11-22: balanced speedup workload, uncapped leases for scaling
  step pipeline_speedup 150 python3 -m bench.pipeline_speedup --timeout 130 --steps 4 --transport nccl; pack
  scale=$( [ "$GPUS" -ge 4 ] && echo 1,2,3 || echo 1 )
  step generator_scaling 200 python3 -m bench.generator_scaling --gpus "$scale" --window 20; pack
  ;;
E)  # 7B: the learner's fp32 AdamW states need ZeRO-3 over two GPUs
  step build_7b 240 python3 -c "from bench.common import build_model as b; b('7b', '/tmp/bench-models/q-7b')"
  step weight_sync_7b 330 python3 -m bench.weight_sync --sizes 7b --transports nccl --learner-gpus 0,1 \
    --generator-gpus 2 --zero-stage 3 --steps 4 --name weight_sync_7b; pack
  ;;
G)  # 2026-11-22, second pass (2 x H200): CUDA graphs in the generators
  step pipeline_speedup_graphs 280 python3 -m bench.pipeline_speedup --timeout 260 --steps 5 --transport nccl \
    --enforce-eager 0 --max-tokens 512 --phases 0,1 --name pipeline_speedup_graphs_g512; pack
  step pipeline_speedup_1.5b 290 python3 -m bench.pipeline_speedup --model-size 1.5b --timeout 270 --steps 3 \
    --transport nccl --enforce-eager 0 --max-tokens 512 --phases 0,1 --name pipeline_speedup_graphs_1.5b; pack
  step generator_overhead 200 python3 -m bench.generator_overhead --gpus 1 --enforce-eager 0; pack
  ;;
H)  # 2026-11-23, third pass (2 x H200): several vLLM engines on the generator GPU (host-bound steps)
  step build 120 python3 -c "from bench.common import build_model as b; b('0.5b', '/tmp/bench-models/q-0.5b')"
  step pytest_gpu 300 python3 -m pytest -q -rs tests/gpu -m gpu -p no:cacheprovider; pack
  step pipeline_speedup_2engines 250 python3 -m bench.pipeline_speedup --timeout 230 --steps 5 --transport nccl \
    --enforce-eager 0 --engines-per-gpu 2 --prompt-tokens 192 --max-tokens 512 --phases 0,1 \
    --name pipeline_speedup_2engines; pack
  ;;
I)
  step pipeline_speedup_3engines 300 python3 -m bench.pipeline_speedup --timeout 280 --steps 5 --transport nccl \
    --enforce-eager 0 --engines-per-gpu 3 --prompt-tokens ${I_PROMPT:-64} --max-tokens ${I_MAX:-512} --phases 0,1 \
    --name pipeline_speedup_3engines; pack
  step weight_sync 200 python3 -m bench.weight_sync --sizes 0.5b --transports nccl --name weight_sync_d997; pack
  ;;
J)  # 2026-11-22, third pass: the staged receive in a thread of each worker
  step build 120 python3 -c "from bench.common import build_model as b; b('0.5b', '/tmp/bench-models/q-0.5b')"
  step pytest_gpu 260 python3 -m pytest -q -rs tests/gpu -m gpu -p no:cacheprovider; pack
  step weight_sync 130 python3 -m bench.weight_sync --sizes 0.5b --transports nccl; pack
  step pipeline_speedup_2engines 200 python3 -m bench.pipeline_speedup --timeout 185 --steps 5 --transport nccl \
    --enforce-eager 0 --engines-per-gpu 2 --prompt-tokens 192 --max-tokens 512 --phases 0,1 \
    --name pipeline_speedup_2engines_thread; pack
  ;;
K)
  step weight_sync_1.5b 170 python3 -m bench.weight_sync --sizes 1.5b --transports nccl --name weight_sync_1.5b; pack
  step pipeline_speedup_3engines 280 python3 -m bench.pipeline_speedup --timeout 260 --steps 5 --transport nccl \
    --enforce-eager 0 --engines-per-gpu 3 --prompt-tokens 192 --max-tokens 512 --phases 0,1 \
    --name pipeline_speedup_3engines; pack
  ;;
L)
  step pipeline_speedup_4engines 345 python3 -m bench.pipeline_speedup --timeout 330 --steps 4 --transport nccl \
    --enforce-eager 0 --engines-per-gpu 4 --prompt-tokens 320 --max-tokens 512 --phases 0,1 \
    --name pipeline_speedup_4engines; pack
  ;;
M)  # 2026-11-22, fourth pass (4 x H200)
  step build 120 python3 -c "from bench.common import build_model as b; b('0.5b', '/tmp/bench-models/q-0.5b')"
  step pytest_gpu 450 python3 -m pytest -q -rs tests/gpu -m gpu -p no:cacheprovider; pack
  ;;
N)
  step generator_scaling 480 python3 -m bench.generator_scaling --gpus 1,2,3 --window 60 --warmup 10; pack
  ;;
O)
  step build_7b 240 python3 -c "from bench.common import build_model as b; b('7b', '/tmp/bench-models/q-7b')"
  step weight_sync_7b 300 python3 -m bench.weight_sync --sizes 7b --transports nccl --learner-gpus 0,1 \
    --generator-gpus 2 --zero-stage 3 --steps 4 --name weight_sync_7b_inflight; pack
  step weight_sync_1.5b 170 python3 -m bench.weight_sync --sizes 1.5b --transports nccl --name weight_sync_1.5b_inflight; pack
  ;;
P)  # next pass: the grouped ZeRO-3 gather (learner/model.py) on GPUs; then `bash bench/run_gpu.sh M` for the tests
  step zero3_gather_7b 150 python3 -m bench.zero3_gather --model-size 7b --gpus 0,1 --name zero3_gather_7b; pack
  step build_7b 240 python3 -c "from bench.common import build_model as b; b('7b', '/tmp/bench-models/q-7b')"
  step weight_sync_7b 300 python3 -m bench.weight_sync --sizes 7b --transports nccl --learner-gpus 0,1 \
    --generator-gpus 2 --zero-stage 3 --steps 4 --name weight_sync_7b_grouped; pack
  ;;
Q)  # 2026-11-22, fifth pass (4 x H200): draining generators are told apart; where the 7B publish's time goes
  step build 120 python3 -c "from bench.common import build_model as b; b('0.5b', '/tmp/bench-models/q-0.5b')"
  step pytest_gpu 420 python3 -m pytest -q -rs tests/gpu -m gpu -p no:cacheprovider; pack
  step zero3_gather_7b 120 python3 -m bench.zero3_gather --model-size 7b --gpus 0,1 --name zero3_gather_7b_copy; pack
  ;;
R)
  step pipeline_speedup_4engines 345 python3 -m bench.pipeline_speedup --timeout 330 --steps 4 --transport nccl \
    --enforce-eager 0 --engines-per-gpu 4 --prompt-tokens 320 --max-tokens 512 --phases 0,1 \
    --name pipeline_speedup_4engines_drain; pack
  ;;
S)
  step zero3_gather_7b 120 python3 -m bench.zero3_gather --model-size 7b --gpus 0,1 --name zero3_gather_7b_deferred; pack
  step build 120 python3 -c "from bench.common import build_model as b; b('0.5b', '/tmp/bench-models/q-0.5b')"
  step pytest_gpu 420 python3 -m pytest -q -rs tests/gpu -m gpu -p no:cacheprovider; pack
  ;;
single)  # one GPU (an H100): the embedded default colocated as shipped, then the 0.5B shape
  step pipeline_run_single 150 python3 -m pipeline.cli run -c configs/gpu-single.yaml --set trainer.total_steps=20 \
    --run-dir /tmp/bench-runs/single-tiny; pack
  step colocated_h100 220 python3 -m bench.colocated --steps 20 --timeout 200 --name colocated_1gpu; pack
  ;;
C)
  step join_latency 120 python3 -m bench.join_latency; pack
  step weight_sync_1.5b 150 python3 -m bench.weight_sync --sizes 1.5b --transports nccl --name weight_sync_1.5b; pack
  step weight_sync_files 230 python3 -m bench.weight_sync --sizes 0.5b --transports shm,zmq --steps 5 --name weight_sync_files
  pack
  left=$(( 560 - ($(date +%s) - T0) ))
  [ "$left" -gt 130 ] && step generator_overhead 130 python3 -m bench.generator_overhead --gpus 1 && pack
  left=$(( 560 - ($(date +%s) - T0) ))
  [ "$left" -gt 100 ] && step colocated "$left" python3 -m bench.colocated --steps 20 --timeout $(( left - 20 )) && pack
  ;;
esac
echo "done in $(( $(date +%s) - T0 ))s"
