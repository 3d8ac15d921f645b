"""Our own forward pass for Llama-style decoders (Llama 2/3, Mistral, Qwen2, SmolLM).

Every projection is a `LoRALinear`, so the multi-LoRA path adds a per-token adapter delta to
q, k, v, o, gate, up and down without the model knowing which adapters exist. When a step folds a
projection's expand into the fused op that consumes its output (that op is in `LoRAStep.fold_into`,
`lora_tuning.folded_ops`), the projection returns its delta (`kernels.LoRADelta`) instead of adding it
and the op adds it: qkv's in the rotary + KV write, gate/up's in SiLU·up, o's and down's in the next
RMSNorm (per-token steps fold all four; segment steps only qkv's and gate/up's).

The forward runs in pieces: everything between two attentions (a layer's o_proj, norm and MLP, the
next layer's norm, qkv_proj, rotary and KV write) is one piece (`LlamaForCausalLM.piece`), and
attention runs between pieces. Eager steps run them in turn; piecewise CUDA graphs
(`engine/piecewise_graphs.py`) capture the pieces and run only attention eagerly.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from kernels import fused, lora_tuning
from kernels.attention import decode_attention, prefill_attention

from .step_input import AttentionMetadata, LoRAStep, StepInput


class LoRALinear(nn.Module):
    """`y = x W^T + b`, plus `expand(shrink(x, A[slot]), B[slot])` for each output slice (added here, or
    returned as a `LoRADelta` when the step folds into `consumer`, the fused op that reads y).

    Slices (q/k/v, gate/up) share one base matmul; `lora_a[i]`/`lora_b[i]` are the stacked
    slot tensors `[S, R, K]` / `[S, N_i, R]` the LoRA manager attaches.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, names: list[str], consumer: str):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.names = list(names)
        if consumer not in lora_tuning.FUSED_CONSUMERS:
            raise ValueError(f"consumer must be one of {sorted(lora_tuning.FUSED_CONSUMERS)}, got {consumer!r}")
        self.consumer = consumer
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(out_sizes)), requires_grad=False) if bias else None
        self.lora_a: list[torch.Tensor] | None = None
        self.lora_b: list[torch.Tensor] | None = None
        self._narrow: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}

    def forward(self, x: torch.Tensor, lora: LoRAStep | None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, kernels.LoRADelta | None]:
        """(y, None) with the adapters' deltas added; or, when `self.consumer` is in `lora.fold_into`, the
        base product and the delta that op adds (in its tiled variant when it is in `lora.tiled_folds`).
        out: where y goes (a buffer that outlives a CUDA-graph piece), else a new tensor."""
        if lora is None or self.lora_a is None:
            return self._base(x, out), None
        lora_a, lora_b = self.slot_stacks(lora.rank_width)
        if lora.side_stream is None:
            y = self._base(x, out)
            h = kernels.lora_shrink_slices(x, lora_a, lora.meta)
        else:  # the base matmul is issued first (H200 decode graphs, 64 rows on 64 adapters: 7.20 -> 7.07 ms)
            main = torch.cuda.current_stream()
            lora.side_stream.wait_stream(main)
            with _matmul_beside_side_stream(x.shape[0]):
                y = self._base(x, out)
            with torch.cuda.stream(lora.side_stream):
                h = kernels.lora_shrink_slices(x, lora_a, lora.meta)
            main.wait_stream(lora.side_stream)
        if self.consumer in lora.fold_into:
            return y, kernels.LoRADelta(h, tuple(lora_b), lora.meta, tiled=self.consumer in lora.tiled_folds)
        kernels.lora_expand_slices(y, h, lora_b, lora.meta)
        return y, None

    def slot_stacks(self, rank_width: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The A and B slot stacks, or views of their first `rank_width` ranks (made once per width and binding)."""
        if rank_width is None or rank_width == self.lora_a[0].shape[1]:
            return self.lora_a, self.lora_b
        bound, a, b = self._narrow.get(rank_width, (None, None, None))
        if bound is not self.lora_a:
            a = [stack[:, :rank_width] for stack in self.lora_a]
            b = [stack[:, :, :rank_width] for stack in self.lora_b]
            self._narrow[rank_width] = self.lora_a, a, b
        return a, b

    def _base(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b: the GEMM `linear` runs (addmm with a bias, mm without), into `out` when given."""
        if out is None:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)


@contextmanager
def _matmul_beside_side_stream(num_tokens: int) -> Iterator[None]:
    """The base matmul of `num_tokens` rows beside a side-stream shrink through cuBLASLt on all but
    `lora_tuning.side_stream_carveout(num_tokens)` SMs, so the shrink starts on SMs of its own instead of waiting
    for the GEMM's tiles (torch applies an SM carveout on its cuBLASLt paths only). Nothing without a carveout."""
    carveout = lora_tuning.side_stream_carveout(num_tokens)
    if not carveout:
        yield
        return
    with cublaslt_preferred():
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(None)


@contextmanager
def cublaslt_preferred() -> Iterator[None]:
    """cuBLASLt preferred for the matmuls issued inside (recorded ones too, in a graph capture); torch's choice
    restored after."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora: kernels.LoRADelta | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed x + residual, x + residual): the residual add (and a pending LoRA delta of x) is fused
        into the norm."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps, lora=lora)


class RotaryEmbedding(nn.Module):
    """cos/sin tables from transformers' own RoPE initialisers (default, llama3, linear, ...)."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)


class Attention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = LoRALinear(config.hidden_size, [q_size, kv_size, kv_size], bias, ["q_proj", "k_proj", "v_proj"],
                                  "rotary_and_write_kv")
        self.o_proj = LoRALinear(q_size, [config.hidden_size], False, ["o_proj"], "add_rms_norm")
        self.rotary = rotary
        self.split = [q_size, kv_size, kv_size]

    def project(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                slot_mapping: torch.Tensor, lora: LoRAStep | None,
                qkv_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [T, heads, D] of x, rotated, with k and v written to the cache (qkv_out: where they live)."""
        qkv, qkv_delta = self.qkv_proj(x, lora, out=qkv_out)
        q, k, v = self.split_qkv(qkv)
        k_cache, v_cache = kv_cache
        fused.rotary_and_write_kv(q, k, v, self.rotary.cos, self.rotary.sin, positions, k_cache, v_cache,
                                  slot_mapping, lora=qkv_delta)
        return q, k, v

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views q [T, heads, D], k and v [T, kv_heads, D] of qkv_proj's output [T, q + 2 kv]."""
        q, k, v = qkv.split(self.split, dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               attn: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's tokens over the cache (their k and v already in it), into `out` when given:
        the leading decode rows in one batched decode attention, the prefill rows in one prefill attention."""
        k_cache, v_cache = kv_cache
        split = attn.num_decode
        if attn.decode_only:
            return decode_attention(q, k_cache, v_cache, attn.block_tables, attn.context_lens, self.scale, out=out)
        if out is None:
            out = torch.empty_like(q)
        if split:
            decode_attention(q[:split], k_cache, v_cache, attn.block_tables[:split], attn.context_lens[:split],
                             self.scale, out=out[:split])
        prefill_attention(q[split:], k_cache, v_cache, attn.block_tables[split:], attn.query_lens[split:],
                          attn.context_lens_list[split:], self.scale, plan=attn.prefill, k=k[split:],
                          v=v[split:], out=out[split:])
        return out


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = LoRALinear(config.hidden_size, [inter, inter], False, ["gate_proj", "up_proj"],
                                       "silu_and_mul")
        self.down_proj = LoRALinear(inter, [config.hidden_size], False, ["down_proj"], "add_rms_norm")

    def forward(self, x: torch.Tensor, lora: LoRAStep | None) -> tuple[torch.Tensor, kernels.LoRADelta | None]:
        """down_proj's output and the LoRA delta still to add to it (see `LoRALinear.forward`)."""
        gate_up, delta = self.gate_up_proj(x, lora)
        return self.down_proj(fused.silu_and_mul(gate_up, lora=delta), lora)


@dataclass
class AttentionInputs:
    """What a piece of the forward hands attention and the next piece: the layer's rotated q, k and v
    [T, heads, D] (k and v already in the cache) and the residual stream."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor


class DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None, pending: kernels.LoRADelta | None,
                         positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                         slot_mapping: torch.Tensor, lora: LoRAStep | None,
                         qkv_out: torch.Tensor | None = None) -> AttentionInputs:
        """The input norm (adding `pending`, the previous layer's MLP delta, and the residual) and the
        attention's projections, with the new k and v written to the cache."""
        h, residual = self.input_layernorm(x, residual, pending)
        q, k, v = self.self_attn.project(h, positions, kv_cache, slot_mapping, lora, qkv_out)
        return AttentionInputs(q, k, v, residual)

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor, lora: LoRAStep | None
                        ) -> tuple[torch.Tensor, torch.Tensor, kernels.LoRADelta | None]:
        """This layer's MLP output, the residual stream before it is added, and the MLP output's LoRA delta
        still to add (the next norm adds both)."""
        attn = self.self_attn
        h, delta = attn.o_proj(attn_out.reshape(-1, attn.num_heads * attn.head_dim), lora)
        h, residual = self.post_attention_layernorm(h, residual, delta)
        h, delta = self.mlp(h, lora)
        return h, residual, delta


class LlamaForCausalLM(nn.Module):
    SUPPORTED_TYPES = ("llama", "mistral", "qwen2")

    def __init__(self, config, max_positions: int):
        super().__init__()
        if config.model_type not in self.SUPPORTED_TYPES:
            raise ValueError(
                f"Unsupported model type {config.model_type!r}; loraserve runs {', '.join(self.SUPPORTED_TYPES)}"
            )
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) \
                and config.sliding_window < max_positions:
            raise ValueError(
                f"Sliding-window attention ({config.sliding_window}) is not supported; "
                f"set max_model_len <= {config.sliding_window}"
            )
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)

    def forward(self, step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Final-norm hidden states [T, hidden]: the pieces, with each layer's attention between two."""
        inputs = self.piece(0, step, kv_caches)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            attn_out = layer.self_attn.attend(inputs.q, inputs.k, inputs.v, kv_cache, step.attention)
            inputs = self.piece(index + 1, step, kv_caches, attn_out, inputs.residual)
        return inputs

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def piece(self, index: int, step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              attn_out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
              qkv_out: torch.Tensor | None = None) -> AttentionInputs | torch.Tensor:
        """Piece `index` of the forward: what runs after attention index-1 (the embedding for the first) and
        before attention `index`, which gets the returned inputs; the last piece returns the final-norm
        hidden states. attn_out and residual: the previous attention's output and the residual stream.
        qkv_out: where the projections put q, k and v."""
        if index == 0:
            x, pending = self.embed_tokens(step.input_ids), None
        else:
            x, residual, pending = self.layers[index - 1].after_attention(attn_out, residual, step.lora)
        if index == len(self.layers):
            return self.norm(x, residual, pending)[0]
        return self.layers[index].before_attention(x, residual, pending, step.positions, kv_caches[index],
                                                   step.attention.slot_mapping, step.lora, qkv_out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler upcasts what it reads, and the greedy kernel reads them
        as they are instead of a float32 copy."""
        head = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head
        return nn.functional.linear(hidden, head)

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights at the real shapes, for benchmarks that cannot download a checkpoint."""
        generator = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if "norm" in name:
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, 0.02, generator=generator)

    def lora_layers(self) -> dict[str, LoRALinear]:
        """Every LoRA-capable linear by module prefix, e.g. `model.layers.0.self_attn.` -> qkv_proj."""
        found = {}
        for i, layer in enumerate(self.layers):
            found[f"model.layers.{i}.self_attn.qkv_proj"] = layer.self_attn.qkv_proj
            found[f"model.layers.{i}.self_attn.o_proj"] = layer.self_attn.o_proj
            found[f"model.layers.{i}.mlp.gate_up_proj"] = layer.mlp.gate_up_proj
            found[f"model.layers.{i}.mlp.down_proj"] = layer.mlp.down_proj
        return found

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """HF module name -> (out_features, in_features) for each of the 7 projections."""
        shapes = {}
        for prefix, linear in self.lora_layers().items():
            parent = prefix.rsplit(".", 1)[0]
            for name, size in zip(linear.names, linear.out_sizes):
                shapes[f"{parent}.{name}"] = (size, linear.in_features)
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        slices: dict[str, tuple[str, int, int]] = {}
        for prefix, linear in self.lora_layers().items():
            parent = prefix.rsplit(".", 1)[0]
            offset = 0
            for name, size in zip(linear.names, linear.out_sizes):
                for kind in ("weight", "bias"):
                    slices[f"{parent}.{name}.{kind}"] = (f"{prefix.removeprefix('model.')}.{kind}", offset, size)
                offset += size
        loaded = set()
        for name, tensor in weights:
            if name in slices:
                target, offset, size = slices[name]
                params[target].data[offset:offset + size].copy_(tensor)
                loaded.add(f"{target}:{offset}")
            elif name == "lm_head.weight":
                target = "embed_tokens.weight" if self.tie_word_embeddings else "lm_head"
                params[target].data.copy_(tensor)
                loaded.add(target)
            elif name.startswith("model.") and name.removeprefix("model.") in params:
                params[name.removeprefix("model.")].data.copy_(tensor)
                loaded.add(name.removeprefix("model."))
            elif "rotary_emb" in name:
                continue
            else:
                raise ValueError(f"Unexpected weight {name!r} in checkpoint")
        expected = {f"{t}:{o}" for t, o, _ in slices.values() if t in params}
        expected |= {n for n in params if not any(n == t for t, _, _ in slices.values())}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"Checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
