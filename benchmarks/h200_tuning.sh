#!/usr/bin/env bash
# One device call that measures the tuning candidate still off by default (about 9.5 minutes on an H200): the down
# projection's LoRA shrink taken by the tiled SiLU·up (LORASERVE_LORA_SILU_SHRINK). First its kernel tests,
# compiled for the GPU, and the engine's GPU tests of it (segment steps against the CPU, tiled decode graphs, the
# switch's A/B harness); then the fused launch against the tiled SiLU·up followed by the SGMV shrink at 8192 tokens,
# per launch shape (`fused_ops.py --ops silu_and_mul_shrink`); then the 128-row decode graphs off and on, on 16
# adapters (tiled, so it applies) and 64 (per token, a control) (`decode_step.py --switch`); then serving's (c)
# against (a) off and on, in the order 0 1 0 1 (`switch_ab.py`), in the time left (it saves each run as it ends).
# Everything lands in $OUT (tuning.log, fused_ops.json, decode_step.json, switch_ab.json).
#
#     bash benchmarks/h200_tuning.sh            # through `device`: run(command="bash benchmarks/h200_tuning.sh")
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
log="$OUT/tuning.log"
began=$SECONDS
timeout 200 python3 -m pytest -q -rf -p no:cacheprovider tests/kernels/test_silu_shrink.py tests/engine/test_cuda.py \
    tests/engine/test_lora_decode_tiles.py tests/engine/test_decode_step_switch.py \
    -k "silu_shrink or down_shrink or tiled_decode_graphs or decode_step_switch" 2>&1 | tail -5 | tee "$log"
timeout 120 python3 benchmarks/fused_ops.py --lora-only --tokens 8192 --ops silu_and_mul_shrink --out "$OUT" \
    2>&1 | tee -a "$log" | grep -E "^op|\*"
timeout 140 python3 benchmarks/decode_step.py --cases lora --batches 128 --adapters 16 64 \
    --cudagraph-mode full_decode_only --switch LORASERVE_LORA_SILU_SHRINK --values 0 1 --out "$OUT" 2>&1 \
    | grep " b128 " | tee -a "$log"
left=$(( 570 - (SECONDS - began) ))
timeout $(( left > 60 ? left : 60 )) python3 benchmarks/switch_ab.py --switch LORASERVE_LORA_SILU_SHRINK \
    --values 0 1 0 1 --out "$OUT" 2>&1 | grep -E "^(a|c)[ :]" | tee -a "$log"
