"""The logits of a flash tile against one key block: `q . k` (or its rotation on read),
the scale, the optional terms (bias, ALiBi, T5 relative bias), the soft-cap and the mask,
in base-2 units (the kernel's softmax calls exp2). Semantics: DESIGN.md and
`jaxattn.reference`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import rope_read
from pallas_kernels.common import HIDDEN_BIAS, LOG2E, MASK_VALUE, relative_position_bucket

__all__ = ["TermRefs", "TileLogits"]


@dataclasses.dataclass(frozen=True)
class TermRefs:
    """The kernel's refs of the optional terms, None where absent: bias and mask
    `[B, H, Rq, Rk]` (each axis full or 1), ALiBi slopes `[Hq]`, T5 table `[Hq, buckets]`,
    and rope-on-read's cos/sin tables `[R, D]`."""

    bias: Any = None
    mask: Any = None
    alibi: Any = None
    rel: Any = None
    rope_tables: Any = None


@dataclasses.dataclass(frozen=True)
class TileLogits:
    """Logits of the `[block_q]` query rows `r0..` of sequence `seq` (head `h`) at
    positions `q_pos`; `kv_len` keys; `row_store` the rows that exist; `rope_cols` the
    (columns, column mask) of rope-on-read's table loads."""

    params: Any  # LogitParams
    terms: TermRefs
    h: Any
    seq: Any
    q_start: Any
    k_start: Any
    r0: Any
    row_store: Any
    q_pos: Any
    kv_len: Any
    block_q: int
    block_kv: int
    precision: Any
    rope_cols: Any = None

    def _tile_of(self, ref, cols, col_ok, other):
        """The [block_q, block_kv] slice of a broadcastable [B, H, Rq, Rk] operand."""
        params, block_q, block_kv = self.params, self.block_q, self.block_kv
        zero = jnp.int32(0)  # (interpret mode wants array indices, not Python ints)
        bb = self.seq if ref.shape[0] > 1 else zero
        hb = self.h if ref.shape[1] > 1 else zero
        row0 = (self.q_start if params.packed_coords else 0) + self.r0
        col0 = (self.k_start if params.packed_coords else 0) + cols
        rq = pl.ds(row0, block_q) if ref.shape[2] > 1 else pl.ds(0, 1)
        rk = pl.ds(col0, block_kv) if ref.shape[3] > 1 else pl.ds(0, 1)
        ok = (self.row_store[:, None] if ref.shape[2] > 1 else True) & (
            col_ok[None, :] if ref.shape[3] > 1 else True
        )
        shape = (block_q if ref.shape[2] > 1 else 1, block_kv if ref.shape[3] > 1 else 1)
        ok = jnp.broadcast_to(ok, shape)
        val = plgpu.load(ref.at[bb, hb, rq, rk], mask=ok, other=other)
        return jnp.broadcast_to(val, (block_q, block_kv))

    def __call__(self, q, k, k0, masked: bool):
        """float32 `[block_q, block_kv]` logits of keys k0.. (K tile `k`), base-2 units;
        masked keys (only checked when `masked`, or with a mask) get MASK_VALUE."""
        params, terms, q_pos = self.params, self.terms, self.q_pos
        block_q, block_kv, precision = self.block_q, self.block_kv, self.precision
        # Base-2 softmax: fold log2(e) into the scale so the inner loop calls exp2.
        qk_scale = params.scale * (1.0 if params.soft_cap is not None else LOG2E)
        extra_scale = 1.0 if params.soft_cap is not None else LOG2E
        cols = k0 + jnp.arange(block_kv)  # [block_kv] key positions
        col_ok = cols < self.kv_len
        if terms.rope_tables is not None:
            s = rope_read.tile_scores(q, k, cols, terms.rope_tables, *self.rope_cols, precision)
        else:
            s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
        s = s * qk_scale
        extra = bias = None
        if terms.bias is not None:
            bias = extra = self._tile_of(terms.bias, k0, col_ok, 0.0).astype(jnp.float32)
        if terms.alibi is not None:
            dist = jnp.abs(q_pos[:, None] - cols[None, :]).astype(jnp.float32)
            term = -terms.alibi[self.h] * dist
            extra = term if extra is None else extra + term
        if terms.rel is not None:
            rel = cols[None, :] - q_pos[:, None]
            buckets = relative_position_bucket(
                rel, terms.rel.shape[-1], params.rel_max_distance, params.rel_bidirectional
            )
            term = terms.rel[self.h, buckets]
            extra = term if extra is None else extra + term
        if extra is not None:
            s = s + extra * extra_scale
        if params.soft_cap is not None:
            s = (params.soft_cap * LOG2E) * jnp.tanh(s / params.soft_cap)
        if bias is not None:  # A bias <= HIDDEN_BIAS (-inf too) masks the key (a soft-cap
            # would make it finite); every logit stays finite.
            s = jnp.where(bias <= HIDDEN_BIAS, MASK_VALUE, jnp.maximum(s, MASK_VALUE))
        visible = None
        if masked:
            visible = jnp.broadcast_to(col_ok[None, :], (block_q, block_kv))
            if params.causal:
                visible &= cols[None, :] <= q_pos[:, None]
            if params.window is not None:
                in_window = cols[None, :] > q_pos[:, None] - params.window
                if params.sink_tokens:
                    in_window |= cols[None, :] < params.sink_tokens
                visible &= in_window
        if terms.mask is not None:
            allowed = self._tile_of(terms.mask, k0, col_ok, False)
            visible = allowed if visible is None else visible & allowed
        return s if visible is None else jnp.where(visible, s, MASK_VALUE)
