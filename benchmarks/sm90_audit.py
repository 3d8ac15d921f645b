"""Offline sm_90 audit of the Triton kernels of a loraserve LoRA step (no GPU needed).

Run from the repository root:

    TRITON_DEFAULT_FP_FUSION=1 .venv/bin/python benchmarks/sm90_audit.py [--batches 64 8192] [--out FILE] [--whatif]
                                                                          [--dump DIR]

A batch of 129 tokens or more audits the segment path (SGMV shrinks, the fused ops' tiled variants).

How: Triton's active driver is replaced by a stub whose target is GPUTarget("cuda", 90, 32); every
`kernel[grid](...)` launch is turned into a warm-up (compile only) and recorded. The real wrappers
(`kernels.lora_triton`, `kernels.fused_triton`, `kernels.paged_attention_triton`, `kernels.greedy_triton`)
are called with CPU tensors of the Llama-3-8B decode shapes (bf16), so constexprs, launch options and
argument specialisations (alignment, ==1 strides) are exactly what the wrappers pass. PDL is forced on
and the multiprocessor count set to 132 (H200), as on the device. Registers / stack / local memory come
from `cuobjdump -res-usage` on the cubin, LDL/STL/LDG counts from `nvdisasm`, dependent-load depth from
the TTGIR (a load's depth = 1 + deepest load feeding its operands; iter_args follow their init values), and so do
the layout conversions and the tensors staged through shared memory (`ttg.convert_layout`, `ttg.local_alloc`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.getcwd())

HIDDEN, Q, KV, MLP, RANK, SLOTS, HEAD_DIM, VOCAB, BLOCK_SIZE = 4096, 4096, 1024, 14336, 16, 64, 128, 128256, 16
MAX_BLOCKS_PER_SEQ = 512  # 8192-token table; one split at batch 64 and 128 either way
SMS, REGS_PER_SM, SMEM_PER_SM, MAX_WARPS, MAX_BLOCKS = 132, 65536, 228 * 1024, 64, 32
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class H200Driver:
    """Enough of a driver for Triton to compile for sm_90 on a machine without a GPU."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


LAUNCHES: list[dict] = []
_run = JITFunction.run


def _recording_run(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    LAUNCHES.append(dict(fn=self.fn.__name__, grid=tuple(grid), kernel=kernel,
                         num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3)))
    return kernel


def _install() -> None:
    driver.set_active(H200Driver())
    JITFunction.run = _recording_run
    import kernels.greedy_triton as greedy_triton
    import kernels.paged_attention_triton as paged
    import kernels.pdl_triton as pdl
    pdl.use_pdl = lambda device: True
    paged.multiprocessor_count = lambda device: SMS
    greedy_triton.multiprocessor_count = lambda device: SMS


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True, check=True).stdout


def _resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = _tool("cuobjdump", "-res-usage", f.name)
        sass = _tool("nvdisasm", "-c", f.name)
    finally:
        os.unlink(f.name)
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
    return dict(regs=int(fields["REG"]), stack=int(fields["STACK"]), local=int(fields["LOCAL"]),
                sass_shared=int(fields["SHARED"]), ldl=sum(o.startswith("LDL") for o in ops),
                stl=sum(o.startswith("STL") for o in ops), ldg=sum(o.startswith("LDG") for o in ops),
                sass_lines=len(ops))


_NAME = re.compile(r"%[\w.$-]+")


def _load_chains(ttgir: str) -> dict:
    """Loads by depth of load-to-load dependence (operands), and loads under an scf.if whose condition
    depends on a load (control dependence)."""
    depth: dict[str, int] = {}
    loads: list[tuple[int, bool]] = []
    stack: list[bool] = []  # per open region: inside an if conditioned on a loaded value
    for line in ttgir.splitlines():
        s = line.strip()
        if s.startswith("}"):
            if stack:
                stack.pop()
            if s.endswith("{"):  # } else {
                stack.append(stack[-1] if stack else False)
            continue
        for init_def, init_use in re.findall(r"(%[\w]+) = (%[\w#]+)", s.split("iter_args", 1)[1]) \
                if "iter_args" in s else []:
            depth[init_def] = depth.get(init_use.split("#")[0], 0)
        m = re.match(r"((?:%[\w]+(?::\d+)?(?:, )?)+) = ([\w.]+)(.*)", s)
        if m:
            defs = [d.split(":")[0] for d in m.group(1).split(", ")]
            op, rest = m.group(2), m.group(3)
            rest = rest.split("iter_args")[0]
            operands = [n.split("#")[0] for n in _NAME.findall(rest.split(" : ")[0])]
            d = max((depth.get(o, 0) for o in operands), default=0)
            if op == "tt.load":
                d += 1
                loads.append((d, any(stack)))
            for name in defs:
                depth[name] = d
            if op == "scf.if":
                stack.append(d > 0)
            elif s.endswith("{"):
                stack.append(False)
        elif s.startswith("scf.if"):
            cond = _NAME.findall(s.split(" : ")[0])
            stack.append(depth.get(cond[0].split("#")[0], 0) > 0 if cond else False)
        elif s.endswith("{"):
            stack.append(False)
    return dict(loads=len(loads), dependent=sum(d >= 2 for d, _ in loads), max_depth=max((d for d, _ in loads), default=0),
                guarded=sum(g for _, g in loads))


def _occupancy(regs: int, smem: int, warps: int) -> tuple[int, str]:
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = (REGS_PER_SM // per_warp) // warps
    by_smem = SMEM_PER_SM // (smem + 1024)
    by_warps = MAX_WARPS // warps
    blocks = min(by_regs, by_smem, by_warps, MAX_BLOCKS)
    limit = min(("regs", by_regs), ("smem", by_smem), ("warps", by_warps), ("blocks", MAX_BLOCKS), key=lambda t: t[1])
    return blocks, limit[0]


def _h200_shapes(batch: int):
    """Tensors laid out as the engine lays them out for one decode bucket."""
    from kernels.lora_metadata import LoRAMetadata
    bf = torch.bfloat16
    # one adapter slot row: per projection slice A [R, in] then B [out, R] (engine/lora_layout.py)
    slices = [("q", HIDDEN, Q), ("k", HIDDEN, KV), ("v", HIDDEN, KV), ("o", Q, HIDDEN),
              ("gate", HIDDEN, MLP), ("up", HIDDEN, MLP), ("down", MLP, HIDDEN)]
    numel = sum(RANK * i + o * RANK for _, i, o in slices)
    slots = torch.empty(SLOTS, numel, dtype=bf)
    a, b, off = {}, {}, 0
    for name, i, o in slices:
        a[name] = slots[:, off:off + RANK * i].view(SLOTS, RANK, i)
        off += RANK * i
        b[name] = slots[:, off:off + o * RANK].view(SLOTS, o, RANK)
        off += o * RANK
    meta = dataclasses.replace(LoRAMetadata.empty(batch, SLOTS, "cpu"), num_tokens=batch)
    rows = torch.zeros(6, batch, dtype=torch.int64)  # ids, positions, KV slots, lengths, adapter slots, rows
    return a, b, meta, rows


def audit(batch: int, whatif: bool = False) -> list[dict]:
    from kernels import fused_triton, greedy_triton, lora_triton, paged_attention_triton
    from kernels.lora_delta import LoRADelta
    bf = torch.bfloat16
    a, b, meta, rows = _h200_shapes(batch)
    x = torch.empty(batch, HIDDEN, dtype=bf)
    residual = torch.empty_like(x)
    weight = torch.empty(HIDDEN, dtype=bf)
    qkv = torch.empty(batch, Q + 2 * KV, dtype=bf)
    q, k, v = (t.view(batch, -1, HEAD_DIM) for t in qkv.split([Q, KV, KV], dim=-1))
    cos = torch.empty(8192, HEAD_DIM, dtype=torch.float32)
    sin = torch.empty_like(cos)
    k_cache = torch.empty(64, BLOCK_SIZE, KV // HEAD_DIM, HEAD_DIM, dtype=bf)
    v_cache = torch.empty_like(k_cache)
    gate_up = torch.empty(batch, 2 * MLP, dtype=bf)
    act = torch.empty(batch, MLP, dtype=bf)
    tables = torch.zeros(batch, MAX_BLOCKS_PER_SEQ, dtype=torch.long)
    logits = torch.empty(batch, VOCAB, dtype=bf)
    positions, slot_mapping, lens = rows[1], rows[2], rows[3]

    steps = []

    def step(label, variant, call):
        start = len(LAUNCHES)
        result = call()
        for launch in LAUNCHES[start:]:
            steps.append(dict(label=label, variant=variant, batch=batch, **launch))
        return result

    h_qkv = step("shrink qkv (3 slices, K=4096)", "LoRA", lambda: lora_triton.shrink_slices(
        x, [a["q"], a["k"], a["v"]], meta))
    h_o = step("shrink o (1 slice, K=4096)", "LoRA", lambda: lora_triton.shrink_slices(act[:, :Q], [a["o"]], meta))
    h_gu = step("shrink gate/up (2 slices, K=4096)", "LoRA", lambda: lora_triton.shrink_slices(
        x, [a["gate"], a["up"]], meta))
    h_down = step("shrink down (1 slice, K=14336)", "LoRA", lambda: lora_triton.shrink_slices(act, [a["down"]], meta))
    step("rotary_and_write_kv (+q/k/v delta)", "LoRA", lambda: fused_triton.rotary_and_write_kv(
        q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping,
        lora=LoRADelta(h_qkv, (b["q"], b["k"], b["v"]), meta)))
    step("rotary_and_write_kv", "base", lambda: fused_triton.rotary_and_write_kv(
        q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping))
    step("decode attention", "base", lambda: paged_attention_triton.paged_attention_decode(
        q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5))
    step("add_rms_norm (+o or down delta)", "LoRA", lambda: fused_triton.add_rms_norm(
        x, residual, weight, 1e-5, lora=LoRADelta(h_o, (b["o"],), meta)))
    step("add_rms_norm", "base", lambda: fused_triton.add_rms_norm(x, residual, weight, 1e-5))
    step("silu_and_mul (+gate/up delta)", "LoRA", lambda: fused_triton.silu_and_mul(
        gate_up, lora=LoRADelta(h_gu, (b["gate"], b["up"]), meta)))
    step("silu_and_mul", "base", lambda: fused_triton.silu_and_mul(gate_up))
    step("greedy", "base", lambda: greedy_triton.greedy(logits, VOCAB))
    if whatif:
        from kernels.fused_triton import LoRAOpConfig
        from kernels.lora_tuning import ShrinkConfig
        for cfg in (ShrinkConfig(16, 512, 1, 4, 1), ShrinkConfig(16, 1024, 1, 8, 1), ShrinkConfig(4, 2048, 1, 4, 1)):
            step(f"what-if shrink qkv r{cfg.block_r} k{cfg.block_k} w{cfg.num_warps}", "LoRA",
                 lambda: lora_triton.shrink_slices(x, [a["q"], a["k"], a["v"]], meta, config=cfg))
        for cfg in (LoRAOpConfig(128, 16, 4), LoRAOpConfig(256, 16, 8), LoRAOpConfig(512, 16, 8)):
            step(f"what-if silu_and_mul chunk{cfg.chunk} w{cfg.num_warps}", "LoRA", lambda: fused_triton.silu_and_mul(
                gate_up, lora=LoRADelta(h_gu, (b["gate"], b["up"]), meta), config=cfg))
        for cfg in (LoRAOpConfig(4096, 16, 16), LoRAOpConfig(1024, 16, 8)):
            step(f"what-if add_rms_norm chunk{cfg.chunk} w{cfg.num_warps}", "LoRA", lambda: fused_triton.add_rms_norm(
                x, residual, weight, 1e-5, lora=LoRADelta(h_o, (b["o"],), meta), config=cfg))
        step("what-if rotary chunk2 w2", "LoRA", lambda: fused_triton.rotary_and_write_kv(
            q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping,
            lora=LoRADelta(h_qkv, (b["q"], b["k"], b["v"]), meta), config=LoRAOpConfig(2, 16, 2)))
    del h_down
    return steps


def row(s: dict) -> dict:
    kern = s["kernel"]
    res = _resources(kern.asm["cubin"])
    chains = _load_chains(kern.asm["ttgir"])
    smem = kern.metadata.shared
    warps = kern.metadata.num_warps
    blocks, limit = _occupancy(res["regs"], smem, warps)
    programs = math.prod(s["grid"])
    ttgir = kern.asm["ttgir"]
    return dict(**{k: s[k] for k in ("label", "variant", "batch", "fn", "grid")}, warps=warps,
                stages=kern.metadata.num_stages, smem=smem, programs=programs, blocks_per_sm=blocks, limit=limit,
                occ_warps=blocks * warps, waves=programs / (blocks * SMS), **res, **chains,
                conversions=ttgir.count("ttg.convert_layout"), staged=ttgir.count("ttg.local_alloc"))


def markdown(rows: list[dict]) -> str:
    head = ("| batch | kernel (variant) | Triton fn | grid | warps | regs/thr | spill (STACK/LOCAL B, LDL/STL) "
            "| smem B | blocks/SM (limit) | warps/SM (occ.) | programs / resident (waves) "
            "| LDG (SASS) | tt.load: total / dep. on a load / max chain / under load-cond if "
            "| layout conversions / tensors staged in smem (TTGIR) |\n")
    head += "|" + "---|" * 14 + "\n"
    lines = []
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['label']} ({r['variant']}) | `{r['fn']}` | {'x'.join(map(str, r['grid']))} "
            f"| {r['warps']} | {r['regs']} | {r['stack']}/{r['local']}, {r['ldl']}/{r['stl']} | {r['smem']} "
            f"| {r['blocks_per_sm']} ({r['limit']}) | {r['occ_warps']} ({100 * r['occ_warps'] // MAX_WARPS}%) "
            f"| {r['programs']} / {r['blocks_per_sm'] * SMS} ({r['waves']:.2f}) | {r['ldg']} "
            f"| {r['loads']} / {r['dependent']} / {r['max_depth']} / {r['guarded']} "
            f"| {r['conversions']} / {r['staged']} |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--whatif", action="store_true", help="also compile alternative launch configs (first batch)")
    parser.add_argument("--dump", default=None, help="directory to write each kernel's ttgir/ptx/sass into")
    args = parser.parse_args()
    _install()
    rows = []
    for batch in args.batches:
        for s in audit(batch, whatif=args.whatif and batch == args.batches[0]):
            rows.append(row(s))
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                stem = f"{args.dump}/b{batch}_{s['fn']}_{s['variant']}_{len(rows)}"
                for ext in ("ttgir", "ptx"):
                    with open(f"{stem}.{ext}", "w") as f:
                        f.write(s["kernel"].asm[ext])
                with open(f"{stem}.cubin", "wb") as f:
                    f.write(s["kernel"].asm["cubin"])
    table = markdown(rows)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table)


if __name__ == "__main__":
    main()
