"""Probe: the gradient of attention on the GPU, variants in isolated processes.

Not a bench set (`bench/run.py`): a quick comparison while tuning the backward kernels.
Each spec runs in its own process with a timeout (a deadlocked Mosaic GPU kernel costs
that process's timeout, not the whole device call) and prints one line, also appended to
`$OUT/probe.txt`:

    PYTHONPATH=. python3 bench/probe_backward.py ours:2 cudnn:2 bwd-mosaic:64x2:2

Specs, then ":" and a shape index into SHAPES (bf16; GQA 32/8 at D128, 16/4 at D256):
- `ours`: `jax.grad` of `sum(out * g)` through `jaxattn.attention` (the automatic kernels);
- `ours-triton`: the same with the Triton forward and backward forced;
- `ours-lengths`: `ours` with q_lengths = kv_lengths = S for every sequence (what lengths
  cost: the padding passes and the masked last blocks, on the same work);
- `cudnn`: the same through `jax.nn.dot_product_attention(implementation="cudnn")`;
- `bwd-mosaic:<block_kv_dq>x<stages>`: `mosaic_backward` alone on `mosaic_forward`'s
  residuals (TFLOP/s at 2.5x the forward's FLOPs).
Times: median of 7 `bench.common.time_op` measurements over two input sets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

D128, D256 = (32, 8, 128), (16, 4, 256)  # Hq, Hkv, D
SHAPES = [  # (batch, seq_len, causal, heads)
    (1, 4096, True, D128), (1, 4096, False, D128), (1, 16384, True, D128), (8, 2048, True, D128),
    (1, 4096, True, D256), (1, 4096, False, D256), (4, 2048, True, D256),
]  # fmt: skip
TIMEOUT_S = 150


def _inputs(batch, seq_len, heads):
    import jax
    import jax.numpy as jnp

    hq, hkv, d = heads
    sets = []
    for seed in range(2):
        ks = jax.random.split(jax.random.key(seed), 4)
        shapes = [(batch, seq_len, h, d) for h in (hq, hkv, hkv, hq)]
        arrays = (jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(ks, shapes, strict=True))
        sets.append(tuple(arrays))
    return sets


def _grad_fn(attend):
    import jax
    import jax.numpy as jnp

    def grads(q, k, v, g):
        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(grads)


def time_variant(variant: str, shape_index: int) -> dict:
    import functools

    import jax

    import jaxattn
    from bench.common import time_op
    from pallas_kernels.mosaic import MosaicBackwardConfig, mosaic_backward, mosaic_forward

    batch, seq_len, causal, heads = SHAPES[shape_index]
    hq, _, d = heads
    scale = d**-0.5
    sets = _inputs(batch, seq_len, heads)
    factor = 3.5
    if variant in ("ours", "ours-triton", "ours-lengths"):
        config, lengths = None, {}
        if variant == "ours-triton":
            backward = jaxattn.FlashBackwardConfig(backend="triton")
            config = jaxattn.FlashPrefillConfig(backend="triton", backward=backward)
        if variant == "ours-lengths":
            full = jax.numpy.full((batch,), seq_len, jax.numpy.int32)
            lengths = dict(q_lengths=full, kv_lengths=full)
        fn = _grad_fn(functools.partial(jaxattn.attention, causal=causal, scale=scale,
                                        config=config, implementation="pallas",
                                        **lengths))  # fmt: skip
    elif variant == "cudnn":
        fn = _grad_fn(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                        scale=scale, implementation="cudnn"))  # fmt: skip
    elif variant.startswith("bwd-mosaic:"):
        block_kv_dq, stages = (int(x) for x in variant.split(":")[1].split("x"))
        config = MosaicBackwardConfig(block_kv_dq, stages)
        opts = dict(causal=causal, scale=scale)
        sets = [(q, k, v, *mosaic_forward(q, k, v, **opts), g) for q, k, v, g in sets]
        fn = jax.jit(functools.partial(mosaic_backward, config=config, **opts))
        factor = 2.5
    else:
        raise ValueError(f"unknown variant {variant!r}")
    timing = time_op(fn, sets, warmup=2, reps=7)
    flops = factor * 4 * batch * seq_len**2 * hq * d * (0.5 if causal else 1.0)
    ms = timing.median_s * 1e3
    return dict(variant=variant, shape=SHAPES[shape_index], ms=round(ms, 4),
                tflops=round(flops / timing.median_s / 1e12, 1))  # fmt: skip


def _run(spec: str) -> str:
    variant, shape_index = spec.rsplit(":", 1)
    start = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--one", variant, shape_index],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        lines = [x[7:] for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        result = lines[0] if lines else f"FAILED rc={proc.returncode} {proc.stderr[-1500:]}"
    except subprocess.TimeoutExpired:
        result = f"TIMEOUT after {TIMEOUT_S} s"
    return f"{spec} [{time.time() - start:.0f} s] {result}"


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print("RESULT", json.dumps(time_variant(argv[1], int(argv[2]))))
        return
    for spec in argv:
        line = _run(spec)
        print(line, flush=True)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.txt"), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
