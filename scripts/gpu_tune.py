"""Targeted GPU timing of kernel variants (dev tool): configs x static/dynamic lengths."""
import functools, time, sys
import numpy as np, jax, jax.numpy as jnp, jaxattn
from jaxattn import FlashPrefillConfig as C
rng = np.random.default_rng(0)
def rnd(*s, dt=jnp.bfloat16): return jnp.asarray(rng.standard_normal(s), dt)
def rel(a, b): a, b = np.asarray(a, np.float64), np.asarray(b, np.float64); return float(np.linalg.norm(a - b) / np.linalg.norm(b))
def timeit(f, *a):
    jax.block_until_ready(f(*a)); t = time.perf_counter(); jax.block_until_ready(f(*a)); n = max(3, int(0.1 / (time.perf_counter() - t)))
    ts = []
    for _ in range(7):
        t = time.perf_counter(); r = None
        for _ in range(n): r = f(*a)
        jax.block_until_ready(r); ts.append((time.perf_counter() - t) / n)
    return float(np.median(ts))
# packed correctness
lens = np.array([1, 300, 0, 77, 128, 5, 260]); cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
q, k, v = rnd(790, 8, 128), rnd(790, 2, 128), rnd(790, 2, 128)
for kw in (dict(causal=True), dict(causal=True, window=50, sink_tokens=3), dict(alibi_slopes=jaxattn.alibi_slopes(8))):
    o, l = jaxattn.ragged_attention(q, k, v, cu, cu, return_lse=True, implementation="pallas", **kw)
    r, rl = jaxattn.ragged_attention(*(x.astype(jnp.float32) for x in (q, k, v)), cu, cu, return_lse=True, implementation="xla", **kw)
    print("packed", list(kw), f"rel {rel(o, r):.1e} pad {float(jnp.abs(o[771:]).max())} lse-pad-inf {bool(jnp.all(jnp.isneginf(l[:, 771:])))}", flush=True)
from jax.experimental.pallas.ops.gpu import attention as jmha
cfgs = [C(128, 64, 8, 3), C(128, 64, 4, 3), C(128, 128, 8, 3), C(64, 64, 4, 3), C(128, 32, 4, 3), C(128, 64, 8, 5)]
for Bn, S, causal in [(1, 4096, False), (1, 4096, True), (8, 2048, True)]:
    q, k, v = rnd(Bn, S, 32, 128), rnd(Bn, S, 8, 128), rnd(Bn, S, 8, 128)
    fl = 4 * Bn * S * S * 32 * 128 / (2 if causal else 1)
    kr, vr = jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2)
    fm = jax.jit(lambda q, k, v: jmha.mha(q, k, v, None, sm_scale=128 ** -0.5, causal=causal))
    line = f"B{Bn} S{S} {'causal' if causal else 'full'}: mha {fl / timeit(fm, q, kr, vr) / 1e12:.0f}"
    lens = jnp.full((Bn,), S, jnp.int32)
    for cfg in cfgs:
        for dyn in (False, True):
            kw = dict(kv_lengths=lens) if dyn else {}
            f = jax.jit(functools.partial(jaxattn.attention, causal=causal, implementation="pallas", config=cfg, **kw))
            try:
                line += f" | {cfg.block_q}x{cfg.block_kv}x{cfg.num_warps}x{cfg.num_stages}{'d' if dyn else 's'} {fl / timeit(f, q, k, v) / 1e12:.0f}"
            except Exception as e:
                line += f" | {cfg} ERR {str(e)[:200]}"
    print(line, flush=True)
