#!/usr/bin/env bash
# One device call that measures tuning candidates (~9 minutes on an H200): the GPU tests of the kernels,
# then the decode step (base and 64 adapters, batches 64 and 128) and the LoRA kernels' layer table at
# rank 16 with programmatic dependent launch off and on (LORASERVE_PDL=0/1). The skinny GEMM's chain
# (`benchmarks/skinny_gemm.py`) runs on its own.
# Everything lands in $OUT (tuning.log and one JSON per benchmark and setting).
#
#     bash benchmarks/h200_tuning.sh            # through `device`: run(command="bash benchmarks/h200_tuning.sh")
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT/pdl0" "$OUT/pdl1"
log="$OUT/tuning.log"
began=$SECONDS
timeout 200 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/kernels tests/engine/test_cuda.py -k "not embedded" \
    2>&1 | tail -12 | tee "$log"
for pdl in 0 1; do
    LORASERVE_PDL=$pdl timeout 150 python3 benchmarks/decode_step.py --batches 64 128 --out "$OUT/pdl$pdl" 2>&1 \
        | grep -v "it/s\]" | tail -4 | sed "s/^/pdl=$pdl /" >> "$log"
    LORASERVE_PDL=$pdl timeout 70 python3 benchmarks/lora_kernels.py --ranks 16 --budget-s 25 --out "$OUT/pdl$pdl" 2>&1 \
        | grep "^r16" | head -12 | sed "s/^/pdl=$pdl /" >> "$log"
    rm -f "$OUT/pdl$pdl/lora_kernels.md"  # the JSON has the same rows
done
tail -c 11000 "$log"
