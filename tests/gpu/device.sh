#!/usr/bin/env bash
# `make test-gpu` on a lent GPU machine that has a CUDA torch and mpi4py but no network and no MPI library.
# Here, once, from the repository root (the wheels travel with the working tree; .whl/ is not committed):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d .whl mpich==5.0.2 mpi4py==4.1.2
# There (carry .whl): bash tests/gpu/device.sh [OUT_DIR]   -> OUT_DIR/gpu.md and gpu.json (default docs/).
# --prefix, not --target: pip --target drops the mpich wheel's lib/ (libmpi.so.12), which mpi4py loads.
set -u
out=${1:-docs}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix /tmp/mpi .whl/*.whl || exit 3
  lib=$(dirname "$(find /tmp/mpi -name libmpi.so.12 | head -1)")
  bin=$(dirname "$(find /tmp/mpi -name mpiexec -type f | head -1)")
  site=$(dirname "$(find /tmp/mpi -type d -name mpi4py | head -1)")
  export PATH=$bin:$PATH PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
# MPI moves host buffers only (the mpi backend stages CUDA tensors): keep MPICH off the GPU
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MPIR_CVAR_ENABLE_GPU=0
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 4
timeout 60 mpiexec -n 2 python3 -c "from mpi4py import MPI; c = MPI.COMM_WORLD; assert c.allreduce(1) == 2" \
  || { echo "mpiexec/mpi4py do not work here: carry the wheels (see the top of this file)"; exit 5; }
# the check stops launching at 480 s; 560 s leaves room for the last part to end and the report to be written
timeout 560 python3 tests/gpu/check.py --out "$out/gpu.md" --json "$out/gpu.json"  # what `make test-gpu PY=python3` runs
