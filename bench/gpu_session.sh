#!/usr/bin/env bash
# What a session lent one H200 runs, in two calls of the device tool made back to back (the second finds the
# machine still warm: no second start). A session has 15 minutes of device time, starts included.
#   bash scripts/gpu_wheels.sh                                              # here, once: the wheels the image lacks
#   run(command="bash bench/gpu_session.sh smoke", carry=[".whl"], timeout_s=420)   # ~6 min: the smoke suite
#   run(command="bash bench/gpu_session.sh bench", carry=[".whl"], timeout_s=420)   # ~6 min: bench/gpu.sh
# smoke: the carried wheels installed, then bench/gpu_smoke.sh (each GPU-only path against its CPU-proven
# reference). bench: bench/gpu.sh in GPU_SH_LIMIT_S seconds (default 400): shardtune vs Trainer vs TRL on the GPU,
# the 1B / 8B rows, the long rows while time is left. Logs and results go to $OUT (set by the device tool) when set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
part=${1:-smoke}
out=${OUT:-$(mktemp -d)}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >"$out/pip.txt" 2>&1 || cat "$out/pip.txt"
fi
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__,
'peft', peft.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
case "$part" in
    smoke)
        bash bench/gpu_smoke.sh --out /tmp/gpu_smoke 2>&1 | tee "$out/smoke.txt"
        status=$?
        (cd /tmp/gpu_smoke && tar czf "$out/smoke_runs.tgz" ./*.log ./*/metrics.jsonl 2>/dev/null)
        exit "$status"
        ;;
    bench)
        GPU_SH_LIMIT_S=${GPU_SH_LIMIT_S:-400} bash bench/gpu.sh 2>&1 | tee "$out/gpu.txt"
        status=$?
        cp bench/results/gpu.md bench/results/gpu-*.json bench/results/gpu_peers.* "$out/" 2>/dev/null
        exit "$status"
        ;;
    *) echo "usage: bash bench/gpu_session.sh smoke|bench" >&2; exit 2 ;;
esac
