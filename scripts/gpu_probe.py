"""One-call GPU probe: compile + correctness of every feature, then prefill timings with a
config sweep next to cuDNN and JAX's Pallas mha. Dev tool; `make bench` is the real harness."""
import functools, itertools, json, os, sys, time, traceback
import numpy as np, jax, jax.numpy as jnp
import jaxattn
from jaxattn import FlashPrefillConfig as C

OUT = os.environ.get("OUT", "/tmp")
print(jax.__version__, jax.devices()[0].device_kind, flush=True)
rng = np.random.default_rng(0)
def rnd(*s, dt=jnp.bfloat16): return jnp.asarray(rng.standard_normal(s), dt)
def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

# ---- correctness
fails = 0
B, T, Tk, Hq, Hkv = 2, 300, 300, 8, 2
cases = [
  ("plain", {}), ("causal", dict(causal=True)), ("window+sinks", dict(causal=True, window=37, sink_tokens=5)),
  ("lengths", dict(causal=True, q_lengths=jnp.array([300, 17]), kv_lengths=jnp.array([300, 200]))),
  ("alibi", dict(causal=True, alibi_slopes=jaxattn.alibi_slopes(Hq))),
  ("softcap", dict(soft_cap=20.0)),
  ("bias", dict(bias=rnd(B, 1, T, Tk, dt=jnp.float32))),
  ("mask", dict(mask=jnp.asarray(rng.random((B, Hq, T, Tk)) > 0.3))),
  ("t5", dict(relative_bias=jaxattn.RelativeBias(rnd(Hq, 32, dt=jnp.float32), 128, True))),
  ("t5uni", dict(causal=True, relative_bias=jaxattn.RelativeBias(rnd(Hq, 32, dt=jnp.float32), 128, False))),
  ("combo", dict(causal=True, window=64, sink_tokens=4, alibi_slopes=jaxattn.alibi_slopes(Hq), soft_cap=30.0)),
]
for D in (64, 80, 96, 128, 256):
  for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
    names = [c for c in cases] if (D == 128 and dt == jnp.bfloat16) else cases[:3]
    q, k, v = rnd(B, T, Hq, D, dt=dt), rnd(B, Tk, Hkv, D, dt=dt), rnd(B, Tk, Hkv, D, dt=dt)
    for name, kw in names:
      try:
        o, l = jaxattn.attention(q, k, v, implementation="pallas", return_lse=True, **kw)
        r, rl = jaxattn.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), implementation="xla", return_lse=True, **kw)
        e = rel(o, r); fin = np.isfinite(np.asarray(rl)); el = float(np.max(np.abs(np.asarray(l)[fin] - np.asarray(rl)[fin])))
        ok = e < (2e-2 if dt != jnp.float32 else 1e-4) and np.all(np.isfinite(np.asarray(o, np.float32)))
        fails += not ok
        print(f"{'ok ' if ok else 'BAD'} D={D} {jnp.dtype(dt).name} {name}: rel={e:.2e} lse={el:.2e}", flush=True)
      except Exception as ex:
        fails += 1; print(f"ERR D={D} {jnp.dtype(dt).name} {name}: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
# packed
lens = np.array([1, 300, 77, 128, 5, 260]); cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
Ttot = int(lens.sum()) + 11
q, k, v = rnd(Ttot, Hq, 128), rnd(Ttot, Hkv, 128), rnd(Ttot, Hkv, 128)
for name, kw in [("causal", dict(causal=True)), ("window", dict(causal=True, window=50, sink_tokens=3))]:
  try:
    o = jaxattn.ragged_attention(q, k, v, cu, cu, implementation="pallas", **kw)
    r = jaxattn.ragged_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), cu, cu, implementation="xla", **kw)
    e = rel(o, r); ok = e < 2e-2 and float(jnp.abs(o[-11:]).max()) == 0; fails += not ok
    print(f"{'ok ' if ok else 'BAD'} packed {name}: rel={e:.2e}", flush=True)
  except Exception as ex:
    fails += 1; print(f"ERR packed {name}: {type(ex).__name__}: {str(ex)[:2000]}", flush=True)
print("correctness failures:", fails, flush=True)

# ---- timing
def timeit(f, *a, n=None):
  jax.block_until_ready(f(*a))
  t = time.perf_counter(); jax.block_until_ready(f(*a)); one = time.perf_counter() - t
  n = max(3, int(0.2 / max(one, 1e-6)))
  ts = []
  for _ in range(5):
    t = time.perf_counter(); r = None
    for _ in range(n): r = f(*a)
    jax.block_until_ready(r); ts.append((time.perf_counter() - t) / n)
  return float(np.median(ts))
from jax.experimental.pallas.ops.gpu import attention as jmha
rows = [(1, 4096, True), (1, 4096, False), (1, 16384, True), (8, 2048, True)]
sweep = [C(128, 64, 8, 3), C(128, 64, 4, 3), C(128, 128, 8, 2), C(128, 32, 4, 3), C(64, 64, 4, 3), C(128, 64, 8, 4), C(128, 128, 8, 3), C(64, 128, 4, 2)]
res = []
for Bn, S, causal in rows:
  Hq, Hkv, D = 32, 8, 128
  q, k, v = rnd(Bn, S, Hq, D), rnd(Bn, S, Hkv, D), rnd(Bn, S, Hkv, D)
  flops = 4 * Bn * S * S * Hq * D / (2 if causal else 1)
  tag = f"B{Bn} S{S} {'causal' if causal else 'full'}"
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  tc = timeit(jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")), q, k, v)
  kr, vr = jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2)
  fm = jax.jit(lambda q, k, v: jmha.mha(q, k, v, None, sm_scale=D ** -0.5, causal=causal))
  em = rel(fm(q, kr, vr), ref); tm = timeit(fm, q, kr, vr)
  line = f"{tag}: cudnn {flops/tc/1e12:.0f} | jax-mha {flops/tm/1e12:.0f} (err {em:.1e})"
  for cfg in sweep:
    try:
      f = jax.jit(functools.partial(jaxattn.attention, causal=causal, implementation="pallas", config=cfg))
      e = rel(f(q, k, v), ref); t = timeit(f, q, k, v)
      line += f" | {cfg.block_q}/{cfg.block_kv}/w{cfg.num_warps}/s{cfg.num_stages} {flops/t/1e12:.0f} (err {e:.1e})"
      res.append(dict(row=tag, cfg=str(cfg), tflops=flops / t / 1e12, err=e))
    except Exception as ex:
      line += f" | {cfg} ERR {type(ex).__name__}: {str(ex)[:300]}"
  print(line, flush=True)
# packed vs dense
lens = np.array([512, 1024, 1536, 2048, 2048, 2560, 3072, 3584]); cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
q, k, v = rnd(16384, 32, 128), rnd(16384, 8, 128), rnd(16384, 8, 128)
fl = sum(4 * s * s * 32 * 128 / 2 for s in lens)
f = jax.jit(lambda q, k, v: jaxattn.ragged_attention(q, k, v, cu, cu, causal=True, implementation="pallas"))
t = timeit(f, q, k, v); print(f"packed 8 mixed (16384 tok): {t*1e3:.3f} ms {fl/t/1e12:.0f} TFLOP/s", flush=True)
json.dump(res, open(f"{OUT}/probe.json", "w"), indent=1)
