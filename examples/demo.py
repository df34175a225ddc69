"""jaxattn demo: a causal GQA prefill through both implementations, dense and packed.

Runs anywhere: on a GPU "pallas" compiles the Triton kernel, elsewhere it runs the same
kernel in Pallas interpret mode (slow, so the shapes here are small).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn


def max_error(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def main() -> None:
    on_gpu = jax.default_backend() == "gpu"
    batch, seq_len, num_q_heads, num_kv_heads, head_dim = (
        (2, 1024, 32, 8, 128) if on_gpu else (2, 96, 8, 2, 64)
    )
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"kernels: {'compiled (Triton)' if on_gpu else 'Pallas interpret mode'}\n")

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, seq_len, num_q_heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_len, num_kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_len, num_kv_heads, head_dim), dtype)
    print(f"dense causal GQA prefill: q {q.shape}, k/v {k.shape} {jnp.dtype(dtype).name}")

    config = jaxattn.FlashPrefillConfig.heuristic(seq_len, seq_len, head_dim, dtype, True)
    print(f"  heuristic kernel config: {config}")
    ref, t_ref = timed(jaxattn.attention, q, k, v, causal=True, implementation="xla")
    out, t_out = timed(jaxattn.attention, q, k, v, causal=True, implementation="pallas")
    print(f"  out {out.shape}; max |pallas - xla| = {max_error(out, ref):.2e}")
    print(f"  first call (compile + run): xla {t_ref:.2f} s, pallas {t_out:.2f} s")

    # The same tokens packed: sequences of mixed lengths back to back, cu_seqlens layout.
    lengths = np.array([seq_len // 3, seq_len, 1, seq_len // 2])
    cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    total = int(lengths.sum()) + 5  # a static bucket with 5 padding tokens at the end
    qp = jax.random.normal(keys[0], (total, num_q_heads, head_dim), dtype)
    kp = jax.random.normal(keys[1], (total, num_kv_heads, head_dim), dtype)
    vp = jax.random.normal(keys[2], (total, num_kv_heads, head_dim), dtype)
    print(f"\npacked causal prefill: lengths {lengths.tolist()} in a bucket of {total} tokens")
    opts = dict(
        causal=True, window=64, sink_tokens=4, alibi_slopes=jaxattn.alibi_slopes(num_q_heads)
    )
    ref = jaxattn.ragged_attention(qp, kp, vp, cu_seqlens, cu_seqlens, implementation="xla", **opts)
    out, lse = jaxattn.ragged_attention(
        qp, kp, vp, cu_seqlens, cu_seqlens, implementation="pallas", return_lse=True, **opts
    )
    print("  options: sliding window 64 + 4 sink tokens + ALiBi")
    print(f"  out {out.shape}, lse {lse.shape}; max |pallas - xla| = {max_error(out, ref):.2e}")
    print(
        f"  padding rows are zeros: {bool(jnp.all(out[-5:] == 0))}, "
        f"their lse is -inf: {bool(jnp.all(jnp.isneginf(lse[:, -5:])))}"
    )


if __name__ == "__main__":
    main()
