"""One of two processes of tests/parallel/test_multiprocess.py: a sharded attention step
(forward and gradient, kernels in interpret mode) on a mesh over both processes' devices,
with gloo collectives on CPU. Checks its own shards against the whole computation done
locally and exits 0 when they agree.

Usage: python multiprocess_worker.py <coordinator host:port> <process id>
"""

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2])
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxattn  # noqa: E402
from pallas_kernels.flash_backward import FlashBackwardConfig  # noqa: E402
from pallas_kernels.flash_prefill import FlashPrefillConfig  # noqa: E402

CONFIG = FlashPrefillConfig(
    16, 16, 4, 1, backward=FlashBackwardConfig(16, 16, 16, 16, (4, 4), (1, 1))
)


def main() -> None:
    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    # 'data' across the processes, 'model' within each.
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    keys = jax.random.split(jax.random.key(0), 4)  # the same inputs in both processes
    q = jax.random.normal(keys[0], (2, 32, 4, 16))
    k = jax.random.normal(keys[1], (2, 32, 2, 16))
    v = jax.random.normal(keys[2], (2, 32, 2, 16))
    g = jax.random.normal(keys[3], (2, 32, 4, 16))

    def put(x):
        sharding = NamedSharding(mesh, P("data", None, "model"))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def loss(q, k, v, g, impl):
        out = jaxattn.attention(q, k, v, causal=True, implementation=impl, config=CONFIG)
        return jnp.sum(out * g), out

    grad = lambda impl: jax.value_and_grad(  # noqa: E731
        lambda *a: loss(*a, impl), argnums=(0, 1, 2), has_aux=True
    )
    step = jax.jit(grad("pallas"))
    (value, out), grads = step(put(q), put(k), put(v), put(g))
    # The whole computation on this process's first device.
    whole = (jax.device_put(x, jax.local_devices()[0]) for x in (q, k, v, g))
    (want_value, want_out), want_grads = grad("xla")(*whole)
    for got, want in ((out, want_out), *zip(grads, want_grads, strict=True)):
        assert got.sharding.spec[0] == "data", got.sharding
        for shard in got.addressable_shards:
            np.testing.assert_allclose(
                shard.data, np.asarray(want)[shard.index], rtol=1e-4, atol=1e-4
            )
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-4)
    print(f"process {jax.process_index()}: ok", flush=True)


if __name__ == "__main__":
    main()
