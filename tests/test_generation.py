"""The generation loop (`jaxattn.generation`): sampling masks on hand examples, the
scheduler's rows, and whole runs of the `Engine` checked token by token, against
transformers' `generate` (same random weights) and against full recomputes of our model
without a cache (its full-sequence mode): greedy tokens are right iff each is the argmax of
the full model's logits at the position before it.

Runs use small buckets and pools, so prompts are chunked, requests wait for slots and
pages, prompt chunks and generation tokens share steps, and requests arrive mid-run.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
from jaxattn.generation import (
    Engine,
    EngineConfig,
    Request,
    SamplingParams,
    Status,
    sample,
    top_k_mask,
    top_p_mask,
)
from jaxattn.generation.sampling import row_keys
from jaxattn.generation.scheduler import Limits, Scheduler
from jaxattn.models import Llama, LlamaConfig

NEG = -np.inf
SMALL = LlamaConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
    num_q_heads=4, num_kv_heads=2, head_dim=8,
)  # fmt: skip


@pytest.fixture(autouse=True)
def float32_matmuls():
    """Full float32 projections, so that cached and recomputed logits agree to ~1e-6."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def small_model():
    return Llama(SMALL, rngs=nnx.Rngs(0))


def prompts(lengths, vocab, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def full_recompute_argmax(model, requests) -> list[np.ndarray]:
    """For each request, the full model's greedy choice after each prefix of `prompt +
    output` (no cache): one forward pass over the whole sequences (right-padded to one
    width, so one compilation), argmax from each prompt's last position on."""
    seqs = [r.prompt + r.output[:-1] for r in requests]
    tokens = np.zeros((len(seqs), 64), np.int32)
    for b, seq in enumerate(seqs):
        tokens[b, : len(seq)] = seq
    lengths = jnp.asarray([len(seq) for seq in seqs])
    logits = nnx.jit(lambda m, x, n: m(x, q_lengths=n))(model, jnp.asarray(tokens), lengths)
    best = np.asarray(jnp.argmax(logits, -1))
    return [best[b, len(r.prompt) - 1 : len(seqs[b])] for b, r in enumerate(requests)]


def assert_clean_end(engine):
    """Every page back in the pool, the manager consistent, one trace per bucket used."""
    assert engine.free_pages == engine.config.num_pages
    checks = {k: bool(v) for k, v in jax.jit(jaxattn.KVCacheManager.check)(engine.manager).items()}
    assert checks["ok"], checks
    assert engine.compilations == len(engine.stats.buckets_used) >= 1


# ------------------------------------------------------------------------- sampling
def test_top_k_mask_hand_example():
    logits = jnp.array([[1.0, 3.0, 2.0, 0.5], [1.0, 2.0, 2.0, 0.0], [4.0, 3.0, 2.0, 1.0]])
    got = top_k_mask(logits, jnp.array([2, 1, 0]))
    want = [[NEG, 3.0, 2.0, NEG], [NEG, 2.0, 2.0, NEG], [4.0, 3.0, 2.0, 1.0]]  # tie kept; 0: off
    np.testing.assert_array_equal(np.asarray(got), want)


def test_top_p_mask_hand_example():
    probs = np.array([[0.5, 0.1, 0.3, 0.1], [0.5, 0.1, 0.3, 0.1], [0.9, 0.05, 0.03, 0.02]])
    logits = jnp.asarray(np.log(probs), jnp.float32)
    # Row 0: 0.5 < 0.7, then 0.5 + 0.3 reaches it: {0, 2}. Row 1: p = 1 keeps all.
    # Row 2: the first token alone exceeds p = 0.1: it is kept (never an empty nucleus).
    got = np.isfinite(np.asarray(top_p_mask(logits, jnp.array([0.7, 1.0, 0.1]))))
    want = [[1, 0, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    np.testing.assert_array_equal(got, np.array(want, bool))


def test_sample_temperature_zero_is_greedy():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((16, 50)), jnp.float32)
    keys = jax.random.split(jax.random.key(1), 16)
    args = (jnp.full(16, 3), jnp.full(16, 0.5))  # top_k, top_p: ignored by greedy rows
    got = sample(logits, keys, jnp.zeros(16), *args)
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))
    # top_k = 1 leaves only the argmax to draw, whatever the temperature.
    got = sample(logits, keys, jnp.full(16, 2.0), jnp.ones(16, jnp.int32), jnp.ones(16))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), -1))


def test_sample_draws_only_inside_the_masks():
    logits = jnp.tile(jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1])), (4000, 1))
    keys = row_keys(jax.random.key(0), jnp.zeros(4000, jnp.int32), jnp.arange(4000))
    ones = jnp.ones(4000)
    top2 = np.asarray(sample(logits, keys, ones, jnp.full(4000, 2), ones))
    assert set(top2.tolist()) == {0, 1}
    assert abs(np.mean(top2 == 0) - 0.4 / 0.7) < 0.03  # renormalised over the top 2
    nucleus = np.asarray(sample(logits, keys, ones, jnp.zeros(4000, jnp.int32), 0.8 * ones))
    assert set(nucleus.tolist()) == {0, 1, 2}  # 0.4 + 0.3 < 0.8: the third is needed
    full = np.asarray(sample(logits, keys, ones, jnp.zeros(4000, jnp.int32), ones))
    np.testing.assert_allclose(np.bincount(full) / 4000, [0.4, 0.3, 0.2, 0.1], atol=0.03)


def test_top_p_one_masks_nothing():
    """1 is off: a float32 cumsum of 32000 probabilities reaches 1 before the tail, which
    `before < top_p` then dropped."""
    logits = 10 * jax.random.normal(jax.random.key(0), (4, 32000))
    np.testing.assert_array_equal(np.asarray(top_p_mask(logits, jnp.ones(4))), np.asarray(logits))


def test_sampling_params_validation():
    bad_seeds = (dict(seed=2**31), dict(seed=-1), dict(seed=1.7))  # folded in as an int32
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                *bad_seeds):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


# ------------------------------------------------------------------------ scheduler
def test_scheduler_chunks_decode_first_and_waits_for_slots_and_pages():
    limits = Limits(max_tokens=10, max_seqs=2, page_size=4, num_pages=5, max_pages_per_seq=8,
                    vocab_size=10)  # fmt: skip
    sched = Scheduler(limits)
    a, b, c = (
        Request([1] * n, max_new_tokens=2, name=x) for n, x in ((13, "a"), (2, "b"), (5, "c"))
    )
    for r in (a, b, c):
        assert sched.submit(r)

    def step(want):
        rows = sched.schedule()
        assert [(r.name, n) for r, n in rows] == want
        sched.complete(rows, [7] * len(rows))

    step([("a", 8), ("b", 2)])  # a commits 4 pages, b 1; c waits for a slot
    assert c.status is Status.WAITING and sched.committed_pages == 5
    step([("b", 1), ("a", 5)])  # b generates first; a's last chunk may be any length
    assert b.status is Status.FINISHED and b.finish_reason == "length" and b.output == [7, 7]
    step([("a", 1)])  # b's slot is free, but c's 2 pages are not: c waits
    assert a.status is Status.FINISHED and c.status is Status.WAITING
    step([("c", 5)])
    assert sched.to_release == [b.slot, a.slot] and c.slot == a.slot == 0


def test_a_blocked_prompt_is_not_overtaken():
    """Three generating rows leave 3 of 6 tokens: no page for a long prompt. A shorter
    prompt admitted after it must not take that leftover (it would then generate and keep
    the budget short, step after step); once a generating row ends, the long prompt's
    chunk comes first."""
    limits = Limits(max_tokens=6, max_seqs=5, page_size=4, num_pages=64, max_pages_per_seq=8,
                    vocab_size=10)  # fmt: skip
    sched = Scheduler(limits)
    gens = [Request([1], n, name=f"g{i}") for i, n in enumerate((2, 9, 9))]
    for r in gens:
        sched.submit(r)
    sched.complete(sched.schedule(), [7] * 3)  # prefilled: the three generate from now
    long, short = Request([1] * 9, 2, name="long"), Request([1, 2], 2, name="short")
    for r in (long, short):
        sched.submit(r)

    def step(want):
        rows = sched.schedule()
        assert [(r.name, n) for r, n in rows] == want
        sched.complete(rows, [7] * len(rows))

    step([("g0", 1), ("g1", 1), ("g2", 1)])  # short held back behind long; g0 ends
    step([("g1", 1), ("g2", 1), ("long", 4)])
    step([("g1", 1), ("g2", 1), ("long", 4)])
    step([("g1", 1), ("g2", 1), ("long", 1), ("short", 2)])


def test_rejections_name_the_reason():
    limits = Limits(max_tokens=8, max_seqs=2, page_size=4, num_pages=6, max_pages_per_seq=8,
                    vocab_size=10)  # fmt: skip
    sched = Scheduler(limits)
    cases = {
        "empty prompt": Request([], 4),
        r"ints in \[0, 10\)": Request([1, 10], 4),
        "max_new_tokens=0": Request([1], 0),
        "a sequence holds 32": Request([1] * 30, 4),
        "needs 7 pages; the cache has 6": Request([1] * 25, 4),
    }
    for reason, request in cases.items():
        assert not sched.submit(request)
        assert request.status is Status.REJECTED
        assert re.search(reason, request.finish_reason), request
    assert not sched.busy


def test_engine_config_validation():
    with pytest.raises(ValueError, match="token_buckets"):
        EngineConfig(16, 4, 2, 4, token_buckets=(8, 4))
    with pytest.raises(ValueError, match="max_seqs=8"):
        EngineConfig(16, 4, 8, 4, token_buckets=(4,))


# ------------------------------------------------------------------------ engine runs
def test_greedy_matches_transformers_generate():
    """4 prompts of different lengths, 32 greedy tokens each: our loop (chunked prompts,
    two arriving mid-run, waits for slots and pages) gives transformers' tokens."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_llama_hf import TINY, hf_model

    from jaxattn.models import load_hf_state_dict

    hf = hf_model({})
    model = load_hf_state_dict(LlamaConfig.from_hf(hf.config), hf.state_dict())
    lengths, new = (13, 3, 8, 17), 32
    texts = prompts(lengths, TINY["vocab_size"], seed=3)
    width = max(lengths)
    left = np.zeros((len(texts), width), np.int64)  # HF batches prompts left-padded
    for b, p in enumerate(texts):
        left[b, width - len(p) :] = p
    with torch.no_grad():
        want = hf.generate(
            input_ids=torch.from_numpy(left),
            attention_mask=torch.from_numpy(left != 0).long(),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        ).numpy()[:, width:]

    # 3 slots for 4 requests; the first three commit 30 of the 34 pages (worst cases of 11,
    # 9 and 10), so the fourth, arriving later, waits for a slot and for its 12 pages.
    config = EngineConfig(num_pages=34, page_size=4, max_seqs=3, max_pages_per_seq=12,
                          token_buckets=(4, 8))  # fmt: skip
    engine = Engine(model, config)
    requests = [Request(p, max_new_tokens=new, name=str(i)) for i, p in enumerate(texts)]
    stats = engine.run(requests, arrivals=[0, 0, 2, 9], progress=False)
    for b, r in enumerate(requests):
        assert (r.status, r.finish_reason) == (Status.FINISHED, "length"), r
        np.testing.assert_array_equal(r.output, want[b], err_msg=f"request {b}")
    assert stats.generated_tokens == 4 * new and stats.prompt_tokens == sum(lengths)
    assert {tokens for tokens, _ in stats.buckets_used} == {4, 8}
    assert_clean_end(engine)


def test_rejected_requests_and_eos_while_others_complete(small_model):
    """Oversized requests are rejected at once with a reason; the others (one stopping at
    an end token, all streaming) complete with the full recompute's greedy tokens."""
    config = EngineConfig(num_pages=24, page_size=4, max_seqs=3, max_pages_per_seq=10,
                          token_buckets=(12,))  # fmt: skip
    texts = prompts((9, 22, 1, 14, 5), SMALL.vocab_size, seed=5)
    requests = [Request(p, max_new_tokens=12, name=str(i)) for i, p in enumerate(texts)]
    too_long = Request([1] * 35, max_new_tokens=8, name="too long for a page table")
    bad_token = Request([1, SMALL.vocab_size], max_new_tokens=4, name="bad token")
    streamed = {}
    for r in requests:
        r.on_token = lambda req, tok: streamed.setdefault(req.name, []).append(tok)
    engine = Engine(small_model, config)
    everything = requests[:2] + [too_long] + requests[2:] + [bad_token]
    engine.run(everything, arrivals=[0, 0, 1, 1, 4, 6, 6], progress=False)
    assert too_long.status is Status.REJECTED and "a sequence holds 40" in too_long.finish_reason
    assert bad_token.status is Status.REJECTED and "ints in [0, 96)" in bad_token.finish_reason
    for r, want in zip(requests, full_recompute_argmax(small_model, requests)):
        assert r.status is Status.FINISHED and streamed[r.name] == r.output
        np.testing.assert_array_equal(r.output, want, r.name)
    assert engine.stats.rejected == 2 and engine.stats.finished == 5
    assert_clean_end(engine)

    # The same request with its 5th token as an end token stops there (reusing the engine).
    r = requests[3]
    eos = r.output[4]
    stop = r.output.index(eos) + 1
    again = Request(r.prompt, max_new_tokens=12, eos_token_ids=(eos,))
    engine.run([again, Request(texts[0], max_new_tokens=12)], progress=False)
    assert again.finish_reason == "eos" and again.output == r.output[:stop]
    assert_clean_end(engine)


def test_a_failed_reserve_writes_nothing(small_model):
    """A request whose max_new_tokens is raised after admission outgrows the pages it was
    admitted with; the step whose reserve fails raises. Its plan had taken the old lengths
    as the new ones and written the new token over the last cached one (page 3, offset 3):
    now the caches are untouched, and the pages committed stay those admission counted."""
    config = EngineConfig(num_pages=4, page_size=4, max_seqs=2, max_pages_per_seq=8,
                          token_buckets=(4,))  # fmt: skip
    engine = Engine(small_model, config)
    grown = Request(list(range(1, 9)), max_new_tokens=2)  # commits pages(9) = 3
    engine.submit(grown)
    engine.submit(Request([5, 6, 7, 8], max_new_tokens=1))  # 1
    engine.step()
    grown.max_new_tokens = 12  # now needs pages(19) = 5
    for _ in range(16):
        before = [np.asarray(x) for x in jax.tree.leaves(engine.caches)]
        try:
            engine.step()
        except RuntimeError as error:
            assert "reserve failed" in str(error)
            break
    else:
        pytest.fail("no step outgrew the pool")
    for was, now in zip(before, jax.tree.leaves(engine.caches), strict=True):
        np.testing.assert_array_equal(was, np.asarray(now))
    assert engine.scheduler.committed_pages == 3 + 1  # as admitted, not the grown request's 5


def test_a_raising_callback_still_releases_an_idle_engines_pages(small_model):
    """An on_token callback that raises on the last token had left the finished request's
    pages held until the next submit and step."""
    config = EngineConfig(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=8,
                          token_buckets=(8,))  # fmt: skip
    engine = Engine(small_model, config)

    def fail_on_finish(request, token):
        if request.status is Status.FINISHED:
            raise ValueError("callback failed")

    with pytest.raises(ValueError, match="callback failed"):
        engine.run([Request([1, 2, 3, 4, 5], max_new_tokens=3, on_token=fail_on_finish)],
                   progress=False)  # fmt: skip
    assert engine.free_pages == config.num_pages


def test_sampled_tokens_do_not_depend_on_batching(small_model):
    """A request's random tokens depend on (engine seed, its seed, positions) only: alone
    or among others, arriving early or late, it draws the same tokens."""
    config = EngineConfig(num_pages=32, page_size=4, max_seqs=4, max_pages_per_seq=8,
                          token_buckets=(16,))  # fmt: skip
    texts = prompts((6, 11, 3, 9), SMALL.vocab_size, seed=7)
    engine = Engine(small_model, config, seed=1)  # idle after each run: reused

    def run(order, arrivals, temperature=1.3):
        params = [SamplingParams(temperature, top_k=20, top_p=0.9, seed=i) for i in order]
        requests = [Request(texts[i], 10, sampling=p) for i, p in zip(order, params)]
        engine.run(requests, arrivals=arrivals, progress=False)
        return {i: r.output for i, r in zip(order, requests)}

    alone = run([1], [0])
    mixed = run([0, 2, 1, 3], [0, 0, 3, 3])
    assert mixed[1] == alone[1]
    assert run([1], [0], temperature=0.0)[1] != alone[1]  # it did sample
    assert_clean_end(engine)


def test_dynamic_ntk_tokens_do_not_depend_on_batching():
    """DynamicNTKScaling rotates each token at its own sequence's length: short requests
    (below the original context: no scaling) draw the same tokens beside a long one (40
    tokens: scaled), as alone. (It had taken the longest row's length for the whole step.)"""
    scaling = jaxattn.DynamicNTKScaling(factor=8.0, original_max_position_embeddings=8)
    model = Llama(dataclasses.replace(SMALL, rope_scaling=scaling), rngs=nnx.Rngs(0))
    config = EngineConfig(num_pages=64, page_size=4, max_seqs=4, max_pages_per_seq=16,
                          token_buckets=(64,))  # fmt: skip
    texts = prompts((3, 3, 3, 40), SMALL.vocab_size, seed=3)
    engine = Engine(model, config, seed=0)  # one engine (one compile) for every run

    def run(order):
        requests = [Request(texts[i], 4, sampling=SamplingParams(1.0, seed=i)) for i in order]
        engine.run(requests, progress=False)
        return {i: r.output for i, r in zip(order, requests)}

    alone = {i: run([i])[i] for i in range(3)}
    mixed = run([0, 1, 2, 3])
    assert all(mixed[i] == alone[i] for i in range(3))
    assert_clean_end(engine)


def test_pallas_kernels_in_the_loop():
    """The loop with `paged_attention(implementation="pallas")` (interpret mode on CPU):
    greedy tokens equal the full recompute's. One layer: interpret mode compiles slowly."""
    pallas = functools.partial(jaxattn.paged_attention, implementation="pallas")
    config = dataclasses.replace(SMALL, num_layers=1)
    model = Llama(config, paged_attention_fn=pallas, rngs=nnx.Rngs(0))
    requests = [Request(p, max_new_tokens=8) for p in prompts((10, 4, 7), SMALL.vocab_size, 9)]
    engine = Engine(model, EngineConfig(16, 4, max_seqs=2, max_pages_per_seq=8, token_buckets=(8,)))
    engine.run(requests, arrivals=[0, 0, 3], progress=False)
    for r, want in zip(requests, full_recompute_argmax(model, requests)):
        np.testing.assert_array_equal(r.output, want)
    assert_clean_end(engine)


def test_a_refused_duplicate_moves_no_default_seed(small_model):
    """Submitting a request twice raises; the next request's default seed is still the
    count of submissions taken (the refused one had counted)."""
    engine = Engine(small_model, EngineConfig(16, 4, max_seqs=2, max_pages_per_seq=8))
    first = engine.submit(Request([1, 2, 3], max_new_tokens=2))
    with pytest.raises(ValueError, match="already submitted"):
        engine.submit(first)
    assert first.sampling.seed == 0
    assert engine.submit(Request([4, 5], max_new_tokens=2)).sampling.seed == 1
