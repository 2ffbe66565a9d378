#!/usr/bin/env bash
# Create .venv and install shardtune into it.
# - A machine whose python already has a CUDA build of torch keeps it: the venv sees the system packages.
# - Anywhere else torch is pinned to the CPU build 2.13.0 (a bare "torch" would pull a multi-GB CUDA build).
# - Every other package at the exact version of constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# the two-host tests (tests/multihost) make network namespaces with iproute2's `ip` (slim images lack it) and
# submit the SLURM recipe to a real SLURM on them (else to a stand-in srun); as root with apt only, best effort
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v slurmd >/dev/null 2>&1 || missing+=(slurmd slurmctld slurm-client munge)
  if [ ${#missing[@]} -gt 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null; } || echo "setup: could not install ${missing[*]} (two-host tests skip or use stand-ins)"
  fi
fi
if [ ! -x .venv/bin/python ]; then
  if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "setup: using the CUDA torch of $PYTHON"
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
  pip install --quiet --disable-pip-version-check "torch==${SHARDTUNE_TORCH_VERSION:-2.13.0}"
fi
# Everything else at the exact versions of constraints.txt (what the README's figures are measured with; renewed by
# scripts/pin.sh). torch is not in it; the torch above is kept by a constraint of its own (its installed version), so
# that a pin can fail here but never make pip replace a machine's CUDA build.
python -c "from importlib.metadata import version; print('torch==' + version('torch'))" >.venv/torch-constraint.txt
pins=(-c constraints.txt -c .venv/torch-constraint.txt)
# DeepSpeed is an sdist whose build imports torch: built against the torch above, without build isolation
if ! python -c "import deepspeed" >/dev/null 2>&1; then
  pip install --quiet --disable-pip-version-check --no-build-isolation "${pins[@]}" "deepspeed==0.19.8"
fi
pip install --quiet --disable-pip-version-check "${pins[@]}" -e ".[dev]"
python -c "from importlib.metadata import version as v; print(f'setup: torch {v(\"torch\")}, transformers {v(\"transformers\")}, peft {v(\"peft\")}')"
