"""Quick GPU correctness spot-check (fp32 precision, packed, lengths); dev tool."""
import numpy as np, jax, jax.numpy as jnp, jaxattn
rng = np.random.default_rng(1)
def rnd(*s, dt): return jnp.asarray(rng.standard_normal(s), dt)
def rel(a, b): a, b = np.asarray(a, np.float64), np.asarray(b, np.float64); return float(np.linalg.norm(a - b) / np.linalg.norm(b))
bad = 0
for dt, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
    for D in (64, 96, 128):
        q, k, v = rnd(2, 257, 8, D, dt=dt), rnd(2, 300, 2, D, dt=dt), rnd(2, 300, 2, D, dt=dt)
        for kw in (dict(causal=True), dict(causal=True, window=40, sink_tokens=3, q_lengths=jnp.array([257, 3]), kv_lengths=jnp.array([300, 100])), dict(mask=jnp.asarray(rng.random((2, 1, 257, 300)) > 0.5), alibi_slopes=jaxattn.alibi_slopes(8))):
            o = jaxattn.attention(q, k, v, implementation="pallas", **kw)
            r = jaxattn.attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="xla", **kw)
            e = rel(o, r); bad += e > tol; print("ok " if e <= tol else "BAD", jnp.dtype(dt).name, D, list(kw), f"{e:.1e}")
lens = np.array([1, 300, 0, 77, 128, 5, 260]); cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
q, k, v = rnd(790, 8, 128, dt=jnp.bfloat16), rnd(790, 2, 128, dt=jnp.bfloat16), rnd(790, 2, 128, dt=jnp.bfloat16)
o, l = jaxattn.ragged_attention(q, k, v, cu, cu, causal=True, return_lse=True, implementation="pallas")
r, rl = jaxattn.ragged_attention(*(x.astype(jnp.float32) for x in (q, k, v)), cu, cu, causal=True, return_lse=True, implementation="xla")
e = rel(o, r); pad = float(jnp.abs(o[771:]).max()); bad += e > 2e-2 or pad != 0
print("packed", f"{e:.1e}", "pad max", pad, "lse", bool(jnp.all(jnp.isneginf(l[:, 771:]))))
print("QUICK CHECK FAILURES:", bad)
