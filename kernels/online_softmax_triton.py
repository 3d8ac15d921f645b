"""The online-softmax step shared by the paged attention kernels (decode and prefill)."""
from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634  # scores are scaled by it on the way in, so the kernels use exp2


@triton.jit
def fold_tile(acc, m, denom, scores, v, IEEE: tl.constexpr):
    """Fold one tile of scores [rows, keys] (log2 units, masked keys at -inf) and its values [keys, dim]
    into the running maximum `m`, normaliser `denom` and unnormalised output `acc` (fp32)."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, denom
