#!/usr/bin/env bash
# One device call that re-checks the GPU paths and re-measures what BENCHMARKS.md reports (~9 minutes on
# an H200): the GPU-only tests, the decode- and prefill-attention micro-benchmarks, then the serving
# benchmark within what is left of the budget. Everything lands in $OUT: session.log and the JSON,
# profiles and (d) timeline the benchmarks write (seven files, within what a device call brings back).
# The fused-op and LoRA-kernel benchmarks (`benchmarks/fused_ops.py`, `benchmarks/lora_kernels.py`) run on their own.
#
#     bash benchmarks/h200_session.sh            # through `device`: run(command="bash benchmarks/h200_session.sh")
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
began=$SECONDS
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_cuda.py tests/engine/test_piecewise_graphs.py \
    tests/kernels tests/engine/test_sampler.py 2>&1 | tail -5 | tee "$OUT/session.log"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_prefill_attention.py tests/kernels/test_greedy.py -k "not model_with_the_triton" 2>&1 | tail -3 | tee -a "$OUT/session.log"
timeout 90 python3 benchmarks/decode_attention.py --out "$OUT" >> "$OUT/session.log" 2>&1
timeout 90 python3 benchmarks/prefill_attention.py --out "$OUT" >> "$OUT/session.log" 2>&1
left=$(( 560 - (SECONDS - began) ))
python3 benchmarks/serving.py --shape llama3-8b --out "$OUT" --budget-s $(( left > 200 ? left - 150 : 60 )) \
    2>&1 | grep -v "it/s\]" | tee -a "$OUT/session.log" | tail -15
