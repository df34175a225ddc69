"""jaxattn demo: continuous-batching generation with a small random-weight Llama.

16 requests of varied prompt lengths are served by `jaxattn.generation.Engine`: prompts
written into the paged KV cache in chunks, generation tokens of the running requests in
the same steps (one jitted step through `paged_attention`, then sampling), requests arriving
mid-run and waiting for a slot and for pages, pages released as requests finish. A 17th
request, too long for the cache, is rejected while the others are served. Greedy requests
are then checked against a full recompute without a cache (the model's full-sequence mode).

Runs anywhere: on a GPU the Pallas kernels compile to Triton, elsewhere they run in Pallas
interpret mode (slow, so the model here is small).
"""

from __future__ import annotations

import functools
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxattn
from jaxattn.generation import Engine, EngineConfig, Request, SamplingParams, Status
from jaxattn.models import Llama, LlamaConfig

MODEL = LlamaConfig(
    vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
    num_q_heads=8, num_kv_heads=2, head_dim=16,
)  # fmt: skip
# A pool of 96 pages of 8 tokens: fewer than the 16 requests need at once, so admission
# waits for pages as well as for the 6 slots. Steps of up to 64 tokens; decode-only steps
# (at most 6 tokens) run in the 8-token bucket.
ENGINE = EngineConfig(
    num_pages=96, page_size=8, max_seqs=6, max_pages_per_seq=16, token_buckets=(8, 64)
)
NUM_REQUESTS = 16
# The end token: with these random weights, one the model often picks, so that some
# requests end early (finish reason "eos") and free their slot and pages at once.
EOS = 147


def make_requests(rng) -> tuple[list[Request], list[int]]:
    """16 requests (4 sampling, 12 greedy) and their arrival steps, plus one too long."""
    requests, arrivals = [], []
    for i in range(NUM_REQUESTS):
        prompt = rng.integers(1, MODEL.vocab_size, int(rng.integers(3, 90))).tolist()
        sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95) if i % 4 == 3 else None
        requests.append(
            Request(
                prompt,
                max_new_tokens=int(rng.integers(12, 33)),
                eos_token_ids=(EOS,),
                sampling=sampling or SamplingParams(),
                name=f"req{i:02d}",
            )
        )
        arrivals.append(0 if i < 6 else 3 * (i - 5))
    too_long = Request([1] * 150, max_new_tokens=8, name="too_long")
    return requests + [too_long], arrivals + [10]


def first_token_step(engine: Engine, seen: dict):
    """Streaming callback: notes the step at which each request's first token arrives."""

    def on_token(request: Request, token: int) -> None:
        seen.setdefault(request.name, engine.stats.steps)

    return on_token


def verify_greedy(model: Llama, requests: list[Request]) -> list[bool]:
    """Each greedy request's tokens against the full model run on `prompt + output`
    without a cache: token i must be the argmax after the prefix before it."""
    width = ENGINE.max_pages_per_seq * ENGINE.page_size
    tokens = np.zeros((len(requests), width), np.int32)
    lengths = []
    for b, r in enumerate(requests):
        seq = r.prompt + r.output[:-1]
        tokens[b, : len(seq)] = seq
        lengths.append(len(seq))
    forward = nnx.jit(lambda m, x, n: m(x, q_lengths=n))
    best = np.asarray(jnp.argmax(forward(model, jnp.asarray(tokens), jnp.asarray(lengths)), -1))
    return [
        best[b, len(r.prompt) - 1 : lengths[b]].tolist() == r.output for b, r in enumerate(requests)
    ]


def main() -> int:
    on_gpu = jax.default_backend() == "gpu"
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 matmuls, no TF32
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    print(f"kernels: {'compiled (Triton)' if on_gpu else 'Pallas interpret mode'}")
    print(f"model: {MODEL.num_layers} layers, d_model {MODEL.hidden_size}, heads "
          f"{MODEL.num_q_heads}/{MODEL.num_kv_heads}x{MODEL.head_dim}, vocab "
          f"{MODEL.vocab_size}, random weights, float32")  # fmt: skip
    print(f"engine: {ENGINE}\n", flush=True)  # before the progress bar (stderr)

    paged = functools.partial(jaxattn.paged_attention, implementation="pallas")
    model = Llama(MODEL, paged_attention_fn=paged, rngs=nnx.Rngs(0))
    engine = Engine(model, ENGINE, seed=0)
    requests, arrivals = make_requests(np.random.default_rng(0))
    first_token: dict[str, int] = {}
    for r in requests:
        r.on_token = first_token_step(engine, first_token)
    stats = engine.run(requests, arrivals=arrivals)

    print()
    for r, arrival in zip(requests, arrivals, strict=True):
        mode = "greedy" if r.sampling.temperature == 0 else "sampled"
        head = f"{r.name} prompt {len(r.prompt):3d}, arrives at step {arrival:2d}"
        if r.status is Status.REJECTED:
            print(f"{head}: REJECTED ({r.finish_reason})")
            continue
        print(f"{head}, first token at step {first_token[r.name]:2d}, {mode}: "
              f"{len(r.output)} tokens ({r.finish_reason})")  # fmt: skip
        print(textwrap.indent(textwrap.fill(" ".join(map(str, r.output)), 88), "    "))
    print(f"\n{stats}")
    print(f"pages free at the end: {engine.free_pages} of {ENGINE.num_pages}")

    greedy = [r for r in requests if r.status is Status.FINISHED and r.sampling.temperature == 0]
    matches = verify_greedy(model, greedy)
    print(
        f"\nfull recompute without cache: {sum(matches)}/{len(greedy)} greedy requests "
        "match token for token"
    )
    served = all(r.status is Status.FINISHED for r in requests[:NUM_REQUESTS])
    return 0 if served and all(matches) and engine.free_pages == ENGINE.num_pages else 1


if __name__ == "__main__":
    sys.exit(main())
