"""Shared inputs (slot patterns, deltas, the rotary-and-cache-write case) and a float64 per-token oracle for the
LoRA kernel tests, and a recorder of kernel calls for the backend-switch tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any

import pytest
import torch

from kernels import LoRADelta, LoRAMetadata, prepare_lora_metadata

NUM_SLOTS = 5

# Slot patterns over the same slot table: name -> per-token slot (-1 = base model).
PATTERNS: dict[str, list[int]] = {
    "all_base": [-1] * 7,
    "one_slot": [2] * 9,
    "distinct": [4, 0, 3, 1, 2],
    "unsorted_with_empty_groups": [3, 0, -1, 3, 1, -1, 0, 3, 1],
    "base_mixed_in": [-1, 4, -1, -1, 4, 0, -1],
}


def slots_tensor(pattern: Sequence[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(pattern, dtype=torch.int32, device=device)


def shrink_reference(x: torch.Tensor, a_slices: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """float64 h[i, t] = A_i[slot_t] @ x[t], zero for base tokens, one token at a time."""
    h = torch.zeros(len(a_slices), x.shape[0], a_slices[0].shape[1], dtype=torch.float64, device=x.device)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for i, a in enumerate(a_slices):
                h[i, t] = a[slot].double() @ x[t].double()
    return h


def expand_reference(
    y: torch.Tensor, h: torch.Tensor, b_slices: Sequence[torch.Tensor], slots: torch.Tensor
) -> torch.Tensor:
    """float64 y + [h_i[t] @ B_i[slot_t]^T side by side], base rows unchanged, one token at a time."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            col = 0
            for i, b in enumerate(b_slices):
                out[t, col : col + b.shape[1]] += b[slot].double() @ h[i, t].double()
                col += b.shape[1]
    return out


def random_weights(
    shape_tail: Sequence[Sequence[int]], dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    """Stacked slot tensors [NUM_SLOTS, *tail] of small random values (no zero padding to hide bugs)."""
    return [torch.randn(NUM_SLOTS, *tail, device=device).div(tail[-1] ** 0.5).to(dtype) for tail in shape_tail]


def packed_weights(
    shape_tail: Sequence[Sequence[int]], dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    """Like `random_weights`, but every stack is a view of one [NUM_SLOTS, slot size] buffer, as the
    engine lays its slots out: slot i of each stack lies in row i, between other stacks' weights (and
    NaN gaps a kernel that strays would pick up)."""
    sizes = [tail[0] * tail[1] for tail in shape_tail]
    buffer = torch.full((NUM_SLOTS, sum(sizes) + 3 * len(sizes)), float("nan"), device=device, dtype=dtype)
    views, offset = [], 0
    for tail, size, weights in zip(shape_tail, sizes, random_weights(shape_tail, dtype, device)):
        offset += 3
        view = buffer[:, offset:offset + size].view(NUM_SLOTS, *tail)
        view.copy_(weights)
        views.append(view)
        offset += size
    return views


def exact_delta(slots: Sequence[int], widths: Sequence[int], rank: int, dtype: torch.dtype, seed: int,
                device: str = "cpu", *, block_m: int | None = None) -> LoRADelta:
    """A `LoRADelta` whose float32 sums are exact in any order: h (zero on base rows, as the shrink leaves them)
    holds multiples of 1/8, B (stacks packed in one buffer) multiples of 1/16. block_m: the metadata's tile height
    (the default follows the token count)."""
    gen = torch.Generator().manual_seed(seed)
    slot_tensor = slots_tensor(slots, device)
    h = torch.randint(-8, 9, (len(widths), len(slots), rank), generator=gen).div(8).to(device)
    h[:, slot_tensor < 0] = 0.0
    b_slices = packed_weights([(w, rank) for w in widths], dtype, device)
    for b in b_slices:
        b.copy_(torch.randint(-8, 9, b.shape, generator=gen).div(16))
    meta = None if block_m is None else LoRAMetadata.empty(len(slots), NUM_SLOTS, device, block_m=block_m)
    return LoRADelta(h, tuple(b_slices), prepare_lora_metadata(slot_tensor, NUM_SLOTS, out=meta))


def fill_past_ranks_(stack: torch.Tensor, slot_ranks: Sequence[int], dim: int, value: float) -> torch.Tensor:
    """Set each slot's entries past its rank along `dim` (A's rows: 1, B's columns: 2) to `value`, in place: the
    padding of slots allocated at the stack's max rank."""
    for slot, rank in enumerate(slot_ranks):
        stack[slot].narrow(dim - 1, rank, stack.shape[dim] - rank).fill_(value)
    return stack


def width_view(stack: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """The first `width` rank rows (A: dim 1) or columns (B: dim 2) of a stack allocated at a larger max rank, as a
    view (no copy), the stack past them set to NaN, in place: what the engine hands the kernels on a step whose
    adapters' ranks all fit `width`. A kernel that reads past the view spreads the NaN."""
    stack.narrow(dim, width, stack.shape[dim] - width).fill_(float("nan"))
    return stack.narrow(dim, 0, width)


def b_columns_read(slot_ranks: Sequence[int], max_rank: int) -> list[int]:
    """The rank columns of each slot's B (and h) the kernels read: its rank rounded up to whole vectors
    (`lora_triton.rank_columns`), at most the max rank. Past them B's padding is never read; up to them it is zero,
    as the engine lays slots out."""
    from kernels.lora_triton import RANK_VECTOR

    vector = int(RANK_VECTOR)
    return [min(-(-rank // vector) * vector, max_rank) for rank in slot_ranks]


def ranked_metadata(slots: Sequence[int], slot_ranks: Sequence[int] | None, device: str = "cpu", *,
                    block_m: int | None = None) -> LoRAMetadata:
    """The metadata of `slots` with each slot's rank (None: no ranks given, every slot read in full)."""
    ranks = None if slot_ranks is None else torch.tensor(slot_ranks, dtype=torch.int32, device=device)
    meta = None if block_m is None else LoRAMetadata.empty(len(slots), NUM_SLOTS, device, block_m=block_m)
    return prepare_lora_metadata(slots_tensor(slots, device), NUM_SLOTS, slot_ranks=ranks, out=meta)


def ranked_deltas(slots: Sequence[int], widths: Sequence[int], max_rank: int, slot_ranks: Sequence[int],
                  dtype: torch.dtype, seed: int, device: str = "cpu", *,
                  block_m: int | None = None) -> tuple[LoRADelta, LoRADelta]:
    """An `exact_delta` over slots of `slot_ranks` padded to `max_rank` (h zero past each token's rank, as the shrink
    leaves it), twice: B's padding NaN past the columns the kernels read (`b_columns_read`) and the slots' ranks in the
    metadata (a kernel that reads there spreads NaN), and B's padding zero with no ranks given (every column read)."""
    delta = exact_delta(slots, widths, max_rank, dtype, seed, device, block_m=block_m)
    for t, slot in enumerate(slots):
        delta.h[:, t, slot_ranks[slot] if slot >= 0 else 0:] = 0.0
    zero = tuple(fill_past_ranks_(b, slot_ranks, 2, 0.0) for b in delta.b_slices)
    read = b_columns_read(slot_ranks, max_rank)
    poisoned = tuple(fill_past_ranks_(b.clone(), read, 2, float("nan")) for b in zero)
    return (LoRADelta(delta.h, poisoned, ranked_metadata(slots, slot_ranks, device, block_m=block_m)),
            LoRADelta(delta.h, zero, ranked_metadata(slots, None, device, block_m=block_m)))


CACHE_BLOCK_SIZE = 4
# (heads, kv_heads, head_dim): the tiny test models, and head counts and half widths that need padding
HEAD_SHAPES = [pytest.param((4, 2, 16), id="tiny"), pytest.param((6, 3, 24), id="padded")]


@dataclass
class RotaryCase:
    """q/k/v views of one qkv row buffer, rotary tables, NaN-poisoned caches (a row no program writes stays NaN)
    and their slots."""

    shape: tuple[int, int, int]
    qkv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor

    @classmethod
    def random(cls, shape: tuple[int, int, int], tokens: int, dtype: torch.dtype, device: str = "cpu") -> RotaryCase:
        """The same case for the same arguments (a fixed seed), so two calls give a case and its twin."""
        heads, kv_heads, dim = shape
        gen = torch.Generator().manual_seed(5)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
        freqs = torch.outer(torch.arange(64.0), 1.0 / 100 ** (torch.arange(0, dim, 2) / dim))
        emb = torch.cat((freqs, freqs), dim=-1).to(device, torch.float64 if dtype == torch.float64 else torch.float32)
        blocks = tokens // CACHE_BLOCK_SIZE + 2
        cache = torch.full((blocks, CACHE_BLOCK_SIZE, kv_heads, dim), float("nan"), dtype=dtype, device=device)
        return cls(shape, qkv, emb.cos(), emb.sin(), torch.randint(0, 64, (tokens,), generator=gen).to(device), cache,
                   cache.clone(), torch.randperm(blocks * CACHE_BLOCK_SIZE, generator=gen)[:tokens].to(device))

    @property
    def widths(self) -> list[int]:
        heads, kv_heads, dim = self.shape
        return [heads * dim, kv_heads * dim, kv_heads * dim]

    def to(self, dtype: torch.dtype) -> RotaryCase:
        return RotaryCase(self.shape, self.qkv.to(dtype), self.cos.to(dtype), self.sin.to(dtype), self.positions,
                          self.k_cache.to(dtype), self.v_cache.to(dtype), self.slot_mapping)

    def run(self, op: Callable[..., None], lora: LoRADelta | None = None, **config: Any) -> None:
        """`op` (a `rotary_and_write_kv`) on this case, with `lora` when given."""
        heads, kv_heads, dim = self.shape
        q, k, v = self.qkv.split(self.widths, dim=-1)
        tokens = self.qkv.shape[0]
        views = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
        lora_args = () if lora is None else (lora,)
        op(*views, self.cos, self.sin, self.positions, self.k_cache, self.v_cache, self.slot_mapping, *lora_args,
           **config)

    def outputs(self) -> list[torch.Tensor]:
        return [self.qkv, self.k_cache, self.v_cache]


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def within_a_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=torch.finfo(got.dtype).eps, atol=1e-6)


def same_op(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two kernels' results for one op on the same inputs: the same to the bit under the interpreter, which
    evaluates each expression as written. Compiled on a GPU, float32 results may differ in their last bits: each
    kernel's arithmetic contracts into fused multiply-adds its own way, and Triton's combine pass folds
    `y + dot(h, B)` into the dot's accumulator, so y joins the rank sum's roundings. Allowed there: 32 float32
    roundings of the largest result. 16-bit results, rounded from those float32 values, stay the same to the bit."""
    if got.is_cuda and got.dtype == torch.float32:
        scale = want.nan_to_num(nan=0.0).abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=32 * torch.finfo(torch.float32).eps * scale,
                                   equal_nan=True)
    else:
        same(got, want)


def replays_the_next_step(step: Callable[[], Sequence[torch.Tensor]], deltas: Sequence[LoRADelta],
                          next_slots: torch.Tensor) -> None:
    """Capture `step` in a CUDA graph, write the next step's slots into the metadata the deltas share and reverse
    their h rows, replay: the kernels read both from device tensors, so the replay must give what a fresh call does."""
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    prepare_lora_metadata(next_slots, NUM_SLOTS, out=deltas[0].meta)
    for delta in deltas:
        delta.h.copy_(delta.h.flip(1))
    graph.replay()
    for got, want in zip(captured, step()):
        same(got, want)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@cache
def triton_runs_in_process() -> bool:
    """Whether the Triton kernels can run here: on CUDA, or interpreted with Triton imported in interpreter mode
    (a fact of the process, found once)."""
    from kernels import lora_triton

    x = torch.ones(1, 16, device="cuda" if torch.cuda.is_available() else "cpu")
    meta = prepare_lora_metadata(torch.zeros(1, dtype=torch.int32, device=x.device), 1)
    try:
        h = lora_triton.shrink_slices(x, [torch.ones(1, 1, 16, device=x.device)], meta)
    except Exception:  # noqa: BLE001 - any failure means "not in this process"
        return False
    return h.item() == 16.0


def skip_without_triton() -> pytest.MarkDecorator:
    """The mark that skips a test (or, as `pytestmark`, a module) where the Triton kernels cannot run in this
    process (`triton_runs_in_process`); a function, so that importing this module does not import Triton."""
    return pytest.mark.skipif(not triton_runs_in_process(),
                              reason="Triton was imported before its interpreter could be enabled")


@dataclass
class Call:
    """One call seen by `record_calls`: what was called, its arguments, and the grid of a Triton launch."""

    name: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    grid: Any = None


class _Recorder:
    """Stands in for a function (records each call) or a Triton kernel (records each `kernel[grid](...)`)."""

    def __init__(self, target: Any, name: str, calls: list[Call]):
        self.target, self.name, self.calls = target, name, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(Call(self.name, args, kwargs))
        return self.target(*args, **kwargs)

    def __getitem__(self, grid: Any):
        launch = self.target[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(Call(self.name, args, kwargs, grid))
            return launch(*args, **kwargs)

        return run


def record_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, *names: str) -> list[Call]:
    """Wrap `owner.<name>` for each name (module functions or Triton kernels, which still run) and return
    the list their calls are appended to, in call order."""
    calls: list[Call] = []
    for name in names:
        monkeypatch.setattr(owner, name, _Recorder(getattr(owner, name), name, calls))
    return calls


# (path, rank block, split K): small launches of each Triton shrink and expand, by test id
KERNEL_PATHS = {"bgmv": ("bgmv", 4, 1), "bgmv_split_k": ("bgmv", 4, 2), "sgmv": ("sgmv", 16, 1),
                "sgmv_split_k": ("sgmv", 16, 3)}


def kernel_paths(*ids: str) -> list:
    """pytest params of (shrink, expand): the Triton launches of `KERNEL_PATHS[id]`, with small explicit configs
    (the expand splits its columns as the shrink splits K)."""
    from kernels import lora_triton
    from kernels.lora_tuning import ExpandConfig, ShrinkConfig

    def launches(path: str, block_r: int, split_k: int) -> tuple:
        return (partial(lora_triton.shrink_slices, path=path,
                        config=ShrinkConfig(block_r=block_r, block_k=16, split_k=split_k, num_warps=4, num_stages=1)),
                partial(lora_triton.expand_slices, path=path,
                        config=ExpandConfig(block_n=16, block_r=block_r, num_warps=4, num_stages=1,
                                            n_blocks=split_k)))

    return [pytest.param(launches(*KERNEL_PATHS[i]), id=i) for i in ids]
