#!/usr/bin/env bash
# One device call that measures tuning candidates (~9 minutes on an H200): the GPU tests of the kernels
# touched, the fused ops with and without the LoRA expand folded in, decode steps with the fold off and on,
# the decode-attention sweep, the greedy kernel's split counts, then the layer GEMMs under cuBLAS settings
# in what is left of the time. Everything lands in $OUT (tuning.log and one JSON per benchmark).
#
#     bash benchmarks/h200_tuning.sh            # through `device`: run(command="bash benchmarks/h200_tuning.sh")
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT/fold0" "$OUT/fold1"
log="$OUT/tuning.log"
began=$SECONDS
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_greedy.py tests/kernels/test_fused_lora.py \
    tests/kernels/test_paged_attention.py tests/engine/test_cuda.py -k "not embedded" 2>&1 | tail -3 | tee "$log"
timeout 90 python3 benchmarks/fused_ops.py --tokens 64 128 --lora-only --out "$OUT" 2>&1 | tail -40 >> "$log"
for fold in 0 1; do
    LORASERVE_LORA_FOLD=$fold timeout 90 python3 benchmarks/decode_step.py --cases lora --batches 64 128 \
        --out "$OUT/fold$fold" 2>&1 | grep -v "it/s\]" | tail -4 >> "$log"
done
timeout 100 python3 benchmarks/decode_attention.py --sweep --out "$OUT" 2>&1 | tail -25 >> "$log"
timeout 50 python3 benchmarks/greedy_kernel.py --out "$OUT" 2>&1 | tail -12 >> "$log"
left=$(( 570 - (SECONDS - began) ))
if (( left > 40 )); then
    timeout $left python3 benchmarks/gemm_settings.py --tokens 64 128 --budget-s $(( left - 25 )) --out "$OUT" 2>&1 \
        | tail -25 >> "$log"
fi
tail -c 11000 "$log"
