"""Probe: context parallelism (ring and Ulysses attention) on the GPUs of one host.

Not a bench set: a first check on a multi-GPU machine, in one command. It needs two or
more GPUs (`jax.device_count()`); each line also goes to `$OUT/probe_ring.txt`:

    PYTHONPATH=. python3 bench/probe_ring.py [--seq 32768] [--check-seq 1024] [--skip-check]

(On CPU: `XLA_FLAGS=--xla_force_host_platform_device_count=4` and small `--seq` /
`--check-seq`, the kernels in interpret mode: a smoke run of the script itself.)

1. Check (bf16, B1, S = `--check-seq` per device, GQA 8/2, D128): `context_parallel_attention`
   (ring zigzag and contiguous, causal; ring full; Ulysses causal), output and gradients
   of `sum(out * g)`, against `jaxattn.attention` on one GPU (the same kernels unsharded)
   and both against the float32 reference: each error next to the one-GPU kernels' own.
2. Time (bf16, B1, S = `--seq`, GQA 32/8, D128, causal): forward and fwd+bwd of the ring
   (zigzag) and of Ulysses on all devices against `jaxattn.attention` on one device at the
   same S: the speed-up and its ratio to the device count. The sharded inputs are laid
   out (zigzag) before timing, as a model does once for all its layers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from bench.common import time_op
from jaxattn.parallel import context_parallel_attention, zigzag_shard, zigzag_unshard

AXIS = "sp"
METHODS = [  # (label, method, layout, causal)
    ("ring zigzag causal", "ring", "zigzag", True),
    ("ring contiguous causal", "ring", "contiguous", True),
    ("ring full", "ring", "contiguous", False),
    ("ulysses causal", "ulysses", "contiguous", True),
]


def _say(line: str) -> None:
    print(line, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_ring.txt"), "a") as f:
        f.write(line + "\n")


def _inputs(seq, hq, hkv, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(1, seq, h, d) for h in (hq, hkv, hkv, hq)]
    return tuple(jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(ks, shapes, strict=True))


def _sharded_op(mesh, n, method, layout, causal, true_order=True):
    """(q, k, v) -> out, the sequence split over the mesh; in true order, or (not
    `true_order`) in the layout's."""
    op = functools.partial(context_parallel_attention, mesh=mesh, axis_name=AXIS, causal=causal,
                           method=method, layout=layout, implementation="pallas")  # fmt: skip
    if layout == "contiguous" or not true_order:
        return op
    return lambda q, k, v: zigzag_unshard(
        op(zigzag_shard(q, n), zigzag_shard(k, n), zigzag_shard(v, n)), n
    )


def _one_gpu_op(causal):
    return functools.partial(jaxattn.attention, causal=causal, implementation="pallas")


def _value_and_grads(op):
    def loss(q, k, v, g):
        out = op(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _errors(got, want):
    (_, out), grads = got
    (_, out_w), grads_w = want
    pairs = zip((out, *grads), (out_w, *grads_w), strict=True)
    return [
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in pairs
    ]


def check(mesh, n, per_device):
    seq, (hq, hkv, d) = per_device * n, (8, 2, 128)
    q, k, v, g = _inputs(seq, hq, hkv, d, seed=1)
    placed = [jax.device_put(x, NamedSharding(mesh, P(None, AXIS))) for x in (q, k, v, g)]
    for label, method, layout, causal in METHODS:
        ref = _value_and_grads(
            functools.partial(jaxattn.attention, causal=causal, implementation="xla")
        )(*(x.astype(jnp.float32) for x in (q, k, v, g)))
        one = _value_and_grads(_one_gpu_op(causal))(q, k, v, g)
        try:
            many = _value_and_grads(_sharded_op(mesh, n, method, layout, causal))(*placed)
        except Exception as e:  # a method the shapes do not allow: say so, go on
            _say(f"check {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        err_many, err_one = _errors(many, ref), _errors(one, ref)
        ok = all(m <= 2 * o + 2e-2 for m, o in zip(err_many, err_one, strict=True))
        finite = all(bool(jnp.isfinite(x).all()) for x in (many[0][1], *many[1]))
        _say(
            f"check {label}: {'ok' if ok and finite else 'MISMATCH'} max |err| vs float32 "
            f"out/dq/dk/dv {np.round(err_many, 4).tolist()} "
            f"(one GPU {np.round(err_one, 4).tolist()}); vs one GPU "
            f"{np.round(_errors(many, one), 4).tolist()}"
        )


def timing(mesh, n, seq):
    hq, hkv, d = 32, 8, 128
    sets = [_inputs(seq, hq, hkv, d, seed=s) for s in (2, 3)]
    flops = 4 * seq * seq * hq * d * 0.5  # causal forward
    rows = [("one GPU", _one_gpu_op(True), [s[:3] for s in sets], list(sets))]
    for label, method, layout, causal in METHODS:
        if causal and label != "ring contiguous causal":
            lay = (lambda x: zigzag_shard(x, n)) if layout == "zigzag" else (lambda x: x)
            placed = [
                tuple(jax.device_put(lay(x), NamedSharding(mesh, P(None, AXIS))) for x in xs)
                for xs in sets
            ]
            op = _sharded_op(mesh, n, method, layout, causal, true_order=False)
            rows.append((label, op, [s[:3] for s in placed], placed))
    base = {}
    for label, op, fwd_sets, grad_sets in rows:
        result = dict(label=label, devices=1 if label == "one GPU" else n, seq=seq)
        for what, fn, arg_sets, factor in (
            ("fwd", jax.jit(op), fwd_sets, 1.0),
            ("fwd+bwd", _value_and_grads(op), grad_sets, 3.5),
        ):
            try:
                ms = time_op(fn, arg_sets, warmup=2, reps=5).median_s * 1e3
            except Exception as e:  # out of memory on one GPU at long S, say
                result[what] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
                continue
            result[what + " ms"] = round(ms, 3)
            result[what + " TFLOP/s per GPU"] = round(
                factor * flops / (ms * 1e-3) / 1e12 / result["devices"], 1
            )
            if label == "one GPU":
                base[what] = ms
            elif what in base:
                result[what + " speed-up"] = round(base[what] / ms, 2)
                result[what + " efficiency"] = round(base[what] / ms / n, 2)
        _say("time " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--check-seq", type=int, default=1024, help="tokens per device")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    n = jax.device_count()
    _say(f"devices: {n} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if n < 2:
        raise SystemExit("probe_ring needs two or more devices")
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices())
    if not args.skip_check:
        check(mesh, n, args.check_seq)
    timing(mesh, n, args.seq)


if __name__ == "__main__":
    main()
