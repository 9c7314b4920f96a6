"""A model-shaped decoder stack with random weights, for `multiwrite bench --model`: what a decode step costs on the
device around the block-table stage.

Per layer: RMSNorm, the QKV projection (one GEMM), the step's K and V written into the layer's paged KV cache
through the slot mappings (`paged_attention.write_kv`), paged attention through the gathered block tables
(`paged_attention.PagedAttention`), the output projection and residual, RMSNorm, a SwiGLU MLP (gate and up in one
GEMM, down) and residual. Left out, and so not in the step's time: the embedding lookup, rotary embeddings, the
final norm, the LM head, sampling, and every collective (one device, no tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from multiwrite.bench.paged_attention import PagedAttention, PagedBatch, write_kv


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder stack. `hidden`, `mlp`: features; heads of `head_dim` features each."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    what: str
    compile_on_cpu: bool = True  # compile FlexAttention on a CPU too (the tiny size runs faster unfused)

    def params(self) -> int:
        """Weights of the stack (embedding and LM head left out)."""
        qkv = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        o = self.q_heads * self.head_dim * self.hidden
        return self.layers * (qkv + o + 3 * self.hidden * self.mlp + 2 * self.hidden)

    def kv_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty(0, dtype=dtype).element_size()


#: The presets of `--model-preset`.
PRESETS = {
    s.name: s
    for s in (
        ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336, "Llama-3-8B's shape"),
        ModelShape("small", 16, 2048, 32, 8, 64, 8192, "about 1B, Llama-3.2-1B's shape; runs on a CPU"),
        ModelShape("tiny", 2, 128, 4, 2, 32, 256, "a test size: seconds on a CPU", compile_on_cpu=False),
    )
}


def model_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU (as served), float32 on a CPU (where bf16 GEMMs are slow or emulated)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class DecoderStack:
    """`shape.layers` decoder layers with random weights and one paged KV cache per layer.

    Args:
        shape: the sizes.
        num_slots: KV-cache slots per layer (a multiple of `block_size`; one dump block is added for PAD tokens).
        block_size: the tables' kernel block size (tokens per page).
        device, dtype: where and in what the weights, activations and caches live.
        attention: a `PagedAttention`.
        seed: the weights' and caches' random seed. The caches start random, so that a read of a page never
            written still differs from the right one.
    """

    def __init__(self, shape: ModelShape, num_slots: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 attention: PagedAttention, seed: int = 0):  # fmt: skip
        self.shape, self.attention, self.block_size = shape, attention, block_size
        g = torch.Generator(device=device).manual_seed(seed)
        s = shape
        qkv_out = (s.q_heads + 2 * s.kv_heads) * s.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g, device=device, dtype=dtype) / rows**0.5).contiguous()

        self.layers = []
        for _ in range(s.layers):
            self.layers.append({
                "norm1": torch.ones(s.hidden, device=device, dtype=dtype), "qkv": weight(s.hidden, qkv_out),
                "o": weight(s.q_heads * s.head_dim, s.hidden),
                "norm2": torch.ones(s.hidden, device=device, dtype=dtype),
                "gate_up": weight(s.hidden, 2 * s.mlp), "down": weight(s.mlp, s.hidden),
            })  # fmt: skip
        rows = num_slots + block_size
        self.k_caches = [torch.randn(s.kv_heads, rows, s.head_dim, generator=g, device=device, dtype=dtype)
                         for _ in range(s.layers)]  # fmt: skip
        self.v_caches = [torch.randn(s.kv_heads, rows, s.head_dim, generator=g, device=device, dtype=dtype)
                         for _ in range(s.layers)]  # fmt: skip
        self.recorded: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, slots: torch.Tensor, batch: PagedBatch, record: bool = False) -> torch.Tensor:
        """One decode step: `x` `[B, hidden]` (one token per batch entry), `slots` int64 `[B]` (the slot mappings
        of the step's tokens, -1 = PAD), `batch` the step's `PagedBatch` (updated already). Returns `[B, hidden]`.
        With `record`, layer 0's q, k, v and attention output are kept in `self.recorded` (for the check)."""
        s = self.shape
        B = x.shape[0]
        for i, w in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,), w["norm1"])
            q, k, v = (h @ w["qkv"]).split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim,
                                            s.kv_heads * s.head_dim], dim=1)  # fmt: skip
            k = k.reshape(B, s.kv_heads, s.head_dim)
            v = v.reshape(B, s.kv_heads, s.head_dim)
            write_kv(self.k_caches[i], slots, k)
            write_kv(self.v_caches[i], slots, v)
            q = q.reshape(B, s.q_heads, 1, s.head_dim)
            o = self.attention(q, self.k_caches[i], self.v_caches[i], batch)
            if record and i == 0:
                self.recorded = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "out": o.clone()}
            x = x + o.reshape(B, s.q_heads * s.head_dim) @ w["o"]
            h = F.rms_norm(x, (s.hidden,), w["norm2"])
            gate, up = (h @ w["gate_up"]).chunk(2, dim=1)
            x = x + (F.silu(gate) * up) @ w["down"]
        return x
