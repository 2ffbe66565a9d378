#!/usr/bin/env bash
# Wheels of what shardtune needs and this workplace's GPU image (python 3.12, torch, transformers, peft, accelerate
# preinstalled, no network) lacks, downloaded here into .whl/ (git-ignored through .git/info/exclude) for the device
# tool's `carry`. bench/gpu_session.sh installs them there. About 52 MB (bitsandbytes is 43 of them).
#   bash scripts/gpu_wheels.sh && then: run(command="bash bench/gpu_session.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
py=.venv/bin/python
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# binary wheels for the GPU machine's python (the versions this machine's setup verified)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 nltk==3.10.4 defusedxml==0.7.1 \
    bitsandbytes==0.50.2 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 trl==1.16.0 liger-kernel==0.8.5
# source-only packages, built here as pure-python wheels
"$py" -m pip wheel -q --no-deps -w .whl rouge_score==0.1.2 deepspeed==0.19.8
du -sh .whl
