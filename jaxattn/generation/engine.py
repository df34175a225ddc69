"""`Engine`: the generation loop. A Python continuous-batching scheduler
(`jaxattn.generation.scheduler`) picks each step's rows; one jit-compiled step releases
finished sequences, grows the page tables, plans the step (`AttentionMetadata`), runs the
model over prompt chunks and generation tokens at once (`Llama.step`, through
`paged_attention`), and samples each row's next token from its last new token's logits.

Static shapes: a step's tokens are padded to the smallest of a few token buckets (T), its
rows to `max_seqs` (S), page tables to `max_pages_per_seq` (M), so a run compiles the step
once per bucket it uses: a token bucket, and whether the step has prompt chunks (steps of
generation rows only run the decode kernel alone: `AttentionMetadata.decode_only`).
`Engine.compilations` counts the traces. The KV caches (one
`PagedKVCache` per layer) and the manager are donated to the step: updated in place.

    engine = Engine(model, EngineConfig(num_pages=256, page_size=16, max_seqs=8,
                                        max_pages_per_seq=32, token_buckets=(16, 128)))
    requests = [Request(prompt, max_new_tokens=32, eos_token_ids=(2,)) for prompt in prompts]
    stats = engine.run(requests)          # or engine.submit(r) / engine.step() by hand
    print(requests[0].output, stats)
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxattn.generation.progress import ProgressBar, RunStats
from jaxattn.generation.sampling import row_keys, sample
from jaxattn.generation.scheduler import Limits, Request, Scheduler, Status
from jaxattn.manager import KVCacheManager, pad_ids
from jaxattn.metadata import AttentionMetadata
from jaxattn.models.llama import Llama
from jaxattn.parallel.tensor import auto_axes, shard_serving

__all__ = ["Engine", "EngineConfig"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the cache and of the steps.

    num_pages, page_size: the KV cache pool (of every layer). max_seqs: requests running
    at once, and rows of every step (S). max_pages_per_seq: page-table width (M); a request
    needs `len(prompt) + max_new_tokens - 1 <= M * page_size`. token_buckets: the step
    sizes T, increasing; the largest is the per-step token budget and must hold a token of
    every running request and a page (`>= max(max_seqs, page_size)`); with at least
    `max_seqs + page_size`, prompts progress even while every other request generates
    (with less, a prompt waits for generating requests to finish, and the prompts admitted
    after it wait behind it).
    """

    num_pages: int
    page_size: int
    max_seqs: int
    max_pages_per_seq: int
    token_buckets: tuple[int, ...] = (256,)

    def __post_init__(self):
        for name in ("num_pages", "page_size", "max_seqs", "max_pages_per_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig: {name}={value!r} must be an int >= 1")
        buckets = tuple(self.token_buckets)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"EngineConfig: token_buckets={buckets}: increasing ints >= 1")
        if buckets[-1] < max(self.max_seqs, self.page_size):
            raise ValueError(
                f"EngineConfig: the largest token bucket {buckets[-1]} must hold a token of "
                f"each of max_seqs={self.max_seqs} rows and a page of {self.page_size}"
            )
        object.__setattr__(self, "token_buckets", buckets)

    def bucket(self, num_tokens: int) -> int:
        """The smallest token bucket holding `num_tokens`."""
        return self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The host-built arrays of one step; T = token bucket, S = max_seqs.

    tokens: int32 `[T]`, packed rows then padding. seq_ids: int32 `[S]`, each row's manager
    row (-1: padding row). q_lens: int32 `[S]`, new tokens per row. lengths: int32 `[S]`,
    each row's length after the step (also the position of the token it samples). last:
    int32 `[S]`, index in tokens of each row's last new token. release: int32 `[S]`, rows
    finished since the last step (-1 padded). temperature, top_p: float32 `[S]`; top_k,
    seeds: int32 `[S]` (see `jaxattn.generation.sampling`).
    """

    tokens: Int[Array, " T"]
    seq_ids: Int[Array, " S"]
    q_lens: Int[Array, " S"]
    lengths: Int[Array, " S"]
    last: Int[Array, " S"]
    release: Int[Array, " S"]
    temperature: Float[Array, " S"]
    top_k: Int[Array, " S"]
    top_p: Float[Array, " S"]
    seeds: Int[Array, " S"]


def _serve_step(
    graphdef, on_trace, gather, state, caches, mgr, inputs: StepInputs, key, decode_only
):
    """One step (jitted; caches and mgr donated): `(tokens int32 [S], ok, caches, mgr)`,
    ok False when the pool could not hold the rows (the scheduler prevents it).
    decode_only (static): every row generates (no prompt chunk): the decode kernel alone.
    gather: None, or under tensor parallelism the logits' shardings (split by vocabulary
    as the lm_head leaves them, then replicated): the logits are gathered once and every
    device samples whole rows (else the sampler's sorts, cumsum and argmax each gather;
    the first constraint keeps XLA from gathering the lm_head's weight instead)."""
    on_trace()
    model = nnx.merge(graphdef, state)
    mgr = mgr.release(inputs.release)
    mgr, ok = mgr.reserve(inputs.seq_ids, inputs.lengths)
    # A failed reserve left the lengths as they were: a plan from them would write the new
    # tokens over cached ones. Every row is padding then (nothing written); step() raises.
    seq_ids = jnp.where(ok, inputs.seq_ids, -1)
    meta = AttentionMetadata.build(
        mgr, seq_ids, inputs.q_lens, inputs.tokens.shape[0], decode_only=decode_only
    )
    logits, caches = model.step(inputs.tokens, caches, meta, logits_indices=inputs.last)
    for sharding in gather or ():
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    keys = row_keys(key, inputs.seeds, inputs.lengths)
    tokens = sample(logits, keys, inputs.temperature, inputs.top_k, inputs.top_p)
    return tokens, ok, caches, mgr


class Engine:
    """Serves `Request`s with `model` (a `jaxattn.models.Llama`, its weights as they are
    now) over paged caches of `config`'s sizes.

    `submit` queues a request (or rejects it: status REJECTED and a reason, the others
    carry on), `step` runs one step and returns its `(request, token)` events, `run`
    serves a list of requests to the end with a progress bar. Sampling is random only
    where a request asks for it; the keys derive from `seed`, the request's seed and the
    token's position.

    With `mesh`, the engine runs tensor-parallel over the mesh axis `tp_axis`
    (`jaxattn.parallel.shard_serving`): `model`'s parameters are placed split (in place),
    each layer's cache split by kv head (each kv head once per device that reads it when
    there are fewer kv heads than devices), the manager and block tables replicated; the
    same tokens come out as on one device. A step then communicates two all-reduces of the
    step's `[T, d_model]` activations per layer (o_proj, down_proj), one for the
    vocabulary-split embedding lookup, and one all-gather of the `[S, V]` logits before
    sampling. Other mesh axes (e.g. "data") see the same step replicated.

        mesh = jax.make_mesh((1, 4), ("data", "tp"))
        engine = Engine(model, config, mesh=mesh, tp_axis="tp")  # shards model in place
    """

    def __init__(
        self,
        model: Llama,
        config: EngineConfig,
        *,
        seed: int = 0,
        mesh: Mesh | None = None,
        tp_axis: str | tuple[str, ...] = "tp",
    ):
        self.config = config
        self.caches = model.init_cache(config.num_pages, config.page_size)
        self.manager = KVCacheManager.create(
            config.num_pages, config.page_size, config.max_seqs, config.max_pages_per_seq
        )
        gather = None
        if mesh is not None:
            self.caches, self.manager = shard_serving(
                model, self.caches, self.manager, mesh, tp_axis
            )
            head = model.embed_tokens.embedding if model.lm_head is None else model.lm_head.kernel
            spec = (*head.get_value().sharding.spec, None, None)  # [V, d] or [d, V]
            vocab = spec[0 if model.lm_head is None else 1]
            mesh = auto_axes(mesh)
            gather = (NamedSharding(mesh, P(None, vocab)), NamedSharding(mesh, P()))
        self.scheduler = Scheduler(
            Limits(
                max_tokens=config.token_buckets[-1],
                max_seqs=config.max_seqs,
                page_size=config.page_size,
                num_pages=config.num_pages,
                max_pages_per_seq=config.max_pages_per_seq,
                vocab_size=model.config.vocab_size,
            )
        )
        self.stats = RunStats(num_pages=config.num_pages)
        graphdef, self._state = nnx.split(model)
        self._step = jax.jit(
            functools.partial(_serve_step, graphdef, self._count_trace, gather),
            donate_argnums=(1, 2),
            static_argnames="decode_only",
        )
        self._release = jax.jit(KVCacheManager.release, donate_argnums=0)
        self._key = jax.random.key(seed)
        self._submitted = 0

    def _count_trace(self) -> None:
        self.stats.compilations += 1

    @property
    def compilations(self) -> int:
        """Traces (so compilations) of the serving step so far: one per bucket used (a token
        bucket, with or without prompt chunks)."""
        return self.stats.compilations

    @property
    def free_pages(self) -> int:
        """Free pages of the pool, read from the device manager."""
        return int(self.manager.num_free_pages)

    def submit(self, request: Request) -> Request:
        """Queues `request` (a request whose sampling seed is None gets its submission
        index), or rejects it if it can never fit. Returns it."""
        queued = self.scheduler.submit(request)  # raises for a request submitted before
        if request.sampling.seed is None:
            request.sampling = dataclasses.replace(request.sampling, seed=self._submitted)
        self._submitted += 1  # (after: a refused duplicate moves no default seed)
        if not queued:
            self.stats.rejected += 1
        return request

    def _take_releases(self) -> Int[Array, " S"]:
        """int32 `[S]`: the rows finished since the last step (-1 padded), now handed
        to the device manager."""
        ids = pad_ids(self.scheduler.to_release, self.config.max_seqs)
        self.scheduler.to_release.clear()
        return ids

    def _inputs(self, rows: list[tuple[Request, int]]) -> StepInputs:
        """The step's arrays (host numpy; `rows` in order, then padding rows)."""
        S, n = self.config.max_seqs, len(rows)
        q_lens = np.array([q for _, q in rows], np.int32)
        chunks = [
            r.prompt[r.prefilled : r.prefilled + q] if r.prefilling else r.output[-1:]
            for r, q in rows
        ]
        tokens = np.zeros(self.config.bucket(int(q_lens.sum())), np.int32)
        tokens[: q_lens.sum()] = np.concatenate(chunks)

        def per_row(values, fill, dtype=np.int32):
            out = np.full(S, fill, dtype)
            out[:n] = values
            return out

        sampling = [r.sampling for r, _ in rows]
        return StepInputs(
            tokens=tokens,
            seq_ids=per_row([r.slot for r, _ in rows], -1),
            q_lens=per_row(q_lens, 0),
            lengths=per_row([r.cached + q for r, q in rows], 0),
            last=per_row(np.cumsum(q_lens) - 1, 0),
            release=self._take_releases(),
            temperature=per_row([p.temperature for p in sampling], 0, np.float32),
            top_k=per_row([p.top_k for p in sampling], 0),
            top_p=per_row([p.top_p for p in sampling], 1, np.float32),
            seeds=per_row([p.seed for p in sampling], 0),
        )

    def step(self) -> list[tuple[Request, int]]:
        """Runs one step (nothing when idle). Returns `(request, token)` for each token
        sampled this step, after calling each request's `on_token`.

        The host waits for the step's tokens: it needs them to plan the next step (end
        tokens, streaming)."""
        if not self.scheduler.busy:
            return []
        scheduler = self.scheduler
        rows = scheduler.schedule()
        inputs = self._inputs(rows)
        pages = scheduler.pages_after(rows)
        prompt_tokens = sum(n for r, n in rows if r.prefilling)
        decode_only = not any(r.prefilling for r, _ in rows)
        traces, start = self.compilations, time.perf_counter()
        tokens, ok, self.caches, self.manager = self._step(
            self._state, self.caches, self.manager, inputs, self._key, decode_only=decode_only
        )
        sampled, ok = jax.device_get((tokens, ok))
        seconds = time.perf_counter() - start
        if not ok:
            raise RuntimeError("Engine.step: reserve failed; the scheduler's page count is off")
        events = scheduler.complete(rows, sampled[: len(rows)])
        self.stats.record_step(
            bucket=(len(inputs.tokens), decode_only),
            prompt_tokens=prompt_tokens,
            generated=len(events),
            finished=sum(r.status is Status.FINISHED for r, _ in events),
            pages=pages,
            seconds=seconds,
            compiled=self.compilations > traces,
        )
        try:
            for r, token in events:
                if r.on_token is not None:
                    r.on_token(r, token)
        finally:  # a callback that raises still leaves an idle engine's pages released
            if not scheduler.busy and scheduler.to_release:  # idle: give the pages back now
                self.manager = self._release(self.manager, self._take_releases())
        return events

    def run(
        self,
        requests: Sequence[Request],
        *,
        arrivals: Sequence[int] | None = None,
        progress: bool = True,
    ) -> RunStats:
        """Serves `requests` until each has finished or been rejected.

        arrivals: request i is submitted once this call has run `arrivals[i]` steps (or
          earlier, when the engine would otherwise sit idle); default: all at once.
        progress: draw a progress bar on stderr.
        Returns the engine's `stats` (counted since its creation).
        """
        arrivals = [0] * len(requests) if arrivals is None else list(arrivals)
        if len(arrivals) != len(requests):
            raise ValueError(f"run: {len(arrivals)} arrivals for {len(requests)} requests")
        pending = collections.deque(sorted(range(len(requests)), key=arrivals.__getitem__))
        first_step = self.stats.steps
        bar = ProgressBar(len(requests)) if progress else None
        while pending or self.scheduler.busy:
            while pending and (
                arrivals[pending[0]] <= self.stats.steps - first_step or not self.scheduler.busy
            ):
                self.submit(requests[pending.popleft()])
            self.step()
            if bar is not None:
                bar.update(self._done(requests), self._note())
        if bar is not None:
            bar.close(self._done(requests), self._note())
        return self.stats

    @staticmethod
    def _done(requests: Sequence[Request]) -> int:
        return sum(r.status in (Status.FINISHED, Status.REJECTED) for r in requests)

    def _note(self) -> str:
        s = self.stats
        return (
            f"step {s.steps}  {s.tokens_per_s:.0f} tok/s  pages "
            f"{self.scheduler.pages_in_use}/{self.config.num_pages}"
        )
