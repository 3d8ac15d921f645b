"""Attention over a paged KV cache: the torch implementation (CPU, and the reference on GPU).

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]`; a sequence's
tokens live in the blocks its block table lists, in order. The KV write and the decode attention
run Triton kernels on CUDA tensors (split-context decode, one launch for K and V, one launch for
all of a step's prefill sequences) and torch elsewhere; `LORASERVE_ATTENTION_BACKEND=triton|torch`
forces one (with `TRITON_INTERPRET=1` the Triton kernels run on the CPU, which is how CI checks them).
The model itself writes the cache through `kernels.fused.rotary_and_write_kv`, which fuses the write
with the rotary embedding (its torch path calls `write_kv_torch`) and follows the fused-op switch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.backend import use_triton

if TYPE_CHECKING:
    from kernels.prefill_attention_triton import PrefillPlan

BACKEND_ENV = "LORASERVE_ATTENTION_BACKEND"


def write_kv_torch(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys and values at their flat cache slots (block * block_size + offset), one
    `index_copy_` per cache: the torch path of `kernels.fused.rotary_and_write_kv`."""
    flat_k = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    flat_v = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, kv_heads, dim] of one sequence, read through its block table."""
    return cache[block_table].flatten(0, 1)[:length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: the Triton kernel on CUDA, torch elsewhere; into `out` when given."""
    if use_triton(BACKEND_ENV, default=q.is_cuda):
        from kernels.paged_attention_triton import paged_attention_decode as triton_decode

        return triton_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=out)
    result = paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    return result if out is None else out.copy_(result)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] -> [B, H, D] (the torch reference)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    keys = k_cache[block_tables].flatten(1, 2)  # [B, L, kvh, D]
    values = v_cache[block_tables].flatten(1, 2)
    length = keys.shape[1]
    qg = q.view(batch, kv_heads, group, dim).float()
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys.float()) * scale
    pad = torch.arange(length, device=q.device)[None, :] >= context_lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # past a sequence's context, the blocks hold another's (or a freed) values, maybe inf or NaN: 0 * NaN is NaN
    values = values.float().masked_fill(pad[:, :, None, None], 0.0)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)
    return out.reshape(batch, heads, dim).to(q.dtype)


def prefill_uses_triton(device: torch.device | str) -> bool:
    """Whether `prefill_attention` runs the Triton kernel on this device (which wants a PrefillPlan per step)."""
    return use_triton(BACKEND_ENV, default=torch.device(device).type == "cuda")


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_lens: list[int], context_lens: list[int], scale: float,
                      plan: PrefillPlan | None = None, k: torch.Tensor | None = None,
                      v: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's prefill rows: the Triton kernel (one launch) on CUDA, the torch loop elsewhere.

    `plan` is the step's PrefillPlan (built once per step; without one the Triton path builds it here);
    k and v (the new tokens' keys and values) serve the torch loop's sequences without earlier context,
    and on CUDA the long fresh prompts the plan leaves to SDPA.
    """
    if not prefill_uses_triton(q.device):
        return paged_attention_prefill(q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, k, v, out)
    from kernels import prefill_attention_triton as triton_prefill

    if plan is None:
        block_q = triton_prefill.DEFAULT_CONFIG.block_q(q.shape[1] // k_cache.shape[2])
        plan = triton_prefill.PrefillPlan.build(query_lens, context_lens, q.device, block_q)
    out = triton_prefill.paged_attention_prefill(q, k_cache, v_cache, block_tables, plan, scale, out=out)
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        if triton_prefill.leaves_to_sdpa(q_len, ctx_len):
            rows = slice(start, start + q_len)
            paged_attention_prefill(q[rows], k_cache, v_cache, block_tables[i:i + 1], [q_len], [ctx_len], scale,
                                    None if k is None else k[rows], None if v is None else v[rows], out=out[rows])
        start += q_len
    return out


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_lens: list[int], context_lens: list[int],
                            scale: float, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for chunks of new tokens: q [T, H, D] (sequences back to back) -> [T, H, D].

    Sequence i's queries are its last query_lens[i] positions of context_lens[i] cached tokens. A
    sequence with no earlier context attends to its own new keys/values (k, v [T, kv_heads, D], when
    given) with a plain causal mask, which lets SDPA pick its flash kernel; others read the cache.
    """
    heads = q.shape[1]
    kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        qi = q[start:start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if q_len == ctx_len and k is not None:
            ki = k[start:start + q_len].transpose(0, 1).unsqueeze(0)
            vi = v[start:start + q_len].transpose(0, 1).unsqueeze(0)
            mask, causal = None, True
        else:
            ki = _gather(k_cache, block_tables[i], ctx_len).transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, D]
            vi = _gather(v_cache, block_tables[i], ctx_len).transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            mask, causal = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos, False
        attn = torch.nn.functional.scaled_dot_product_attention(
            qi, ki.to(qi.dtype), vi.to(qi.dtype), attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=kv_heads != heads,
        )
        out[start:start + q_len] = attn.squeeze(0).transpose(0, 1)
        start += q_len
    return out
