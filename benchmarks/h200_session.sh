#!/usr/bin/env bash
# One device call that re-checks the GPU paths and re-measures the serving figures BENCHMARKS.md reports
# (about 9.5 minutes on an H200): every GPU-only test of the engine and kernels (more than 4 minutes since the
# decode graphs of 32 rows and more are captured three times with adapter slots; the
# tensor-parallel file needs two GPUs), then the serving benchmark within what is left. Everything lands
# in $OUT: session.log and the JSON, profiles and (d) timeline serving.py writes. The attention, fused-op,
# LoRA-kernel and decode-step benchmarks (`benchmarks/decode_attention.py`, `prefill_attention.py`,
# `fused_ops.py`, `lora_kernels.py`, `decode_step.py`) run on their own.
#
#     bash benchmarks/h200_session.sh            # through `device`: run(command="bash benchmarks/h200_session.sh")
#     bash benchmarks/h200_session.sh kernels    # instead: every kernel test on CUDA, the interpreter's ones too
#     bash benchmarks/h200_session.sh tests      # only the GPU tests, in up to 570 s (an H100 needs more than 450)
#     bash benchmarks/h200_session.sh serving    # only the serving benchmark, in 570 s
#
# The kernels' unmarked tests, and the engine's tests of the Triton folds, run under the Triton interpreter in
# CI; on a GPU they run compiled, where fused multiply-adds and reduction trees follow each kernel's layout
# (`lora_cases.same_op`). `kernels` runs them all there and keeps their whole output.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
if [ "${1:-}" = kernels ]; then
    # two processes at once (about 6 minutes): the compiles are CPU-bound and the machine has 16 cores
    tiled=(tests/kernels/test_fused_lora_tiles.py tests/engine/test_lora_decode_tiles.py
           tests/engine/test_lora_fold_prefill.py)
    timeout 480 python3 -m pytest -q -p no:cacheprovider --tb=line -rf "${tiled[@]}" > "$OUT/tiles_cuda.log" 2>&1 &
    timeout 400 python3 -m pytest -q -p no:cacheprovider --tb=line -rf tests/kernels \
        --ignore=tests/kernels/test_fused_lora_tiles.py > "$OUT/kernels_cuda.log" 2>&1 &
    wait
    tail -n 20 "$OUT/tiles_cuda.log" "$OUT/kernels_cuda.log"
    exit 0
fi
began=$SECONDS
tests_s=$([ "${1:-}" = tests ] && echo 570 || echo 450)
if [ "${1:-}" != serving ]; then
    timeout $tests_s python3 -m pytest -v -m gpu -p no:cacheprovider tests/engine tests/kernels \
        --ignore=tests/engine/test_tensor_parallel.py 2>&1 | tee "$OUT/tests.log" | tail -5 | tee "$OUT/session.log"
fi
[ "${1:-}" = tests ] && exit 0
left=$(( 570 - (SECONDS - began) ))
python3 benchmarks/serving.py --shape llama3-8b --out "$OUT" --budget-s $(( left > 160 ? left - 80 : 80 )) \
    2>&1 | grep -v "it/s\]" | tee -a "$OUT/session.log" | tail -15
