#!/usr/bin/env bash
# Prepare, on a machine with network, what the GPU machine (Python 3.12, x86-64, its own CUDA torch, no
# network) lacks to run `make gpu-report`: wheels in .whl/ (ignored by git), at most 64 MiB together
# with the checkout, since that is what one command there may carry. See docs/measuring.md.
#
#   bash tools/gpu_wheels.sh          # or: make gpu-wheels
#
# What the GPU machine already has (KINDS.md beside the device tool's README): torch 2.11 (CUDA 13),
# accelerate, huggingface-hub, tokenizers, safetensors, numpy, scipy, scikit-learn, pandas, pyarrow,
# pytest, einops, msgpack, ninja, psutil, py-cpuinfo, nvidia-ml-py, triton. Versions below are the ones
# `make test` runs here (requirements/st6.txt, requirements/test.txt, the st6 environment).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.whl
LIMIT_MIB=62  # 64 MiB per command, less the checkout itself
ST_VERSION=${ST_VERSION:-6.2.0}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
# DeepSpeed's needs the GPU machine lacks (pydantic and its own), datasets' (tests import it),
# pytorch-metric-learning (a test extra) and peft (the LoRA extra; part 8).
EXTRA=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0
       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pytorch-metric-learning==2.9.0 peft==0.21.2)
PY=${PYTHON:-python3}
# A python with torch builds DeepSpeed's wheel and packs the model: the st6 environment where it exists.
TORCH_PY=${TORCH_PYTHON:-$([ -x .venv/st6/bin/python ] && echo .venv/st6/bin/python || echo "$PY")}

PLATFORM=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

rm -rf "$DEST" && mkdir -p "$DEST"

echo "== wheels from the registry (cp312, manylinux x86-64)"
"$PY" -m pip download -q "${PLATFORM[@]}" -d "$DEST" \
    "sentence-transformers==$ST_VERSION" "transformers==$TRANSFORMERS_VERSION" "${EXTRA[@]}"

echo "== the released sdists the patch tests unpack (the GPU machine cannot download them): $DEST/sdists"
"$PY" -m pip download -q --no-binary :all: --no-deps -d "$DEST/sdists" "sentence-transformers==$ST_VERSION"

echo "== DeepSpeed $DEEPSPEED_VERSION: published as source only; a pure-Python wheel, its kernels left to JIT"
DS_BUILD_OPS=0 "$TORCH_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$DEEPSPEED_VERSION"

echo "== flash-attention: a wheel for cp312 / manylinux x86-64?"
if "$PY" -m pip download -q "${PLATFORM[@]}" --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_35_x86_64 -d "$DEST" flash-attn 2>/dev/null; then
    echo "flash-attn: $(ls "$DEST"/flash_attn-*.whl)"
else
    echo "flash-attn: no wheel in the registry (source only; building it needs the GPU machine's CUDA torch and"
    echo "  hours). flash-attn-4 is a wheel, but its CUTLASS DSL libraries (nvidia-cutlass-dsl-libs-cu13) alone are"
    echo "  about 88 MiB, over the limit. Part 5 uses PyTorch's own varlen_attn (a FlashAttention kernel in torch)."
fi

echo "== all-MiniLM-L6-v2, float16 and compressed (tools/gpu_minilm.py)"
"$TORCH_PY" tools/gpu_minilm.py pack "$DEST/all-MiniLM-L6-v2-fp16.tar.xz"

echo "== $DEST"
ls -lR "$DEST" | grep "^-" | awk '{printf "%10.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -sb "$DEST" | cut -f1)
checkout=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
awk -v t="$total" -v c="$checkout" 'BEGIN { printf "total %.1f MiB (+ checkout %.1f MiB = %.1f of 64 MiB)\n", t / 1048576, c / 1048576, (t + c) / 1048576 }'
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "over $LIMIT_MIB MiB: the GPU machine cannot carry all of it" >&2
    exit 1
fi
