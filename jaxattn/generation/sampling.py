"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), per row.

Every function takes a batch of rows with per-row parameters as arrays, so one compiled
serving step serves requests with different settings:

  logits       float `[B, V]`
  temperature  float32 `[B]`; 0 = greedy (argmax of the raw logits)
  top_k        int32 `[B]`; keep the k most likely tokens, 0 = off
  top_p        float32 `[B]`; keep the fewest most likely tokens whose probability reaches
               p (at least one), 1 = off

The order is transformers' `generate`: temperature, then top-k, then top-p over what top-k
kept, then one categorical draw. Ties at a threshold are all kept (as in transformers).
A row's key comes from (engine key, request seed, position of the sampled token), so a
request's tokens do not depend on which other requests share its steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["SamplingParams", "row_keys", "sample", "top_k_mask", "top_p_mask"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens (the defaults are greedy).

    temperature: 0 for greedy, else the logits are divided by it.
    top_k: keep only the k most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens with probability >= top_p (1: all).
    seed: the request's random stream; None = its submission index in the engine.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams: temperature={self.temperature} must be >= 0")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k={self.top_k} must be an int >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p={self.top_p} must be in (0, 1]")
        if self.seed is not None and (
            int(self.seed) != self.seed or not 0 <= self.seed < 2**31
        ):  # the engine folds it into a key as an int32
            raise ValueError(f"SamplingParams: seed={self.seed} must be an int in [0, 2**31)")


def _descending(logits):
    return -jnp.sort(-logits, axis=-1)


def top_k_mask(logits: Float[Array, "B V"], top_k: Int[Array, " B"]) -> Float[Array, "B V"]:
    """`logits` with -inf below each row's k-th largest value (rows with k <= 0 unchanged)."""
    kth = jnp.take_along_axis(
        _descending(logits), jnp.clip(top_k - 1, 0, logits.shape[-1] - 1)[:, None], axis=-1
    )  # [B, 1]
    drop = (top_k[:, None] > 0) & (logits < kth)
    return jnp.where(drop, -jnp.inf, logits)


def top_p_mask(logits: Float[Array, "B V"], top_p: Float[Array, " B"]) -> Float[Array, "B V"]:
    """`logits` with -inf outside the nucleus: the most likely tokens, in decreasing order,
    while the probability before each one is below `top_p` (the first is always kept);
    rows with `top_p >= 1` unchanged (a float32 cumsum reaches 1 before the tail)."""
    ordered = _descending(logits)  # [B, V]
    probs = jax.nn.softmax(ordered.astype(jnp.float32), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)  # [B]
    threshold = jnp.take_along_axis(ordered, kept[:, None] - 1, axis=-1)  # [B, 1]
    drop = (logits < threshold) & (top_p[:, None] < 1)
    return jnp.where(drop, -jnp.inf, logits)


def row_keys(key: jax.Array, seeds: Int[Array, " B"], positions: Int[Array, " B"]) -> jax.Array:
    """One typed key per row: `key` folded with the row's request seed, then with the
    position of the token it samples."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(key, s), p))(
        seeds, positions
    )


def sample(
    logits: Float[Array, "B V"],
    keys: jax.Array,
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
) -> Int[Array, " B"]:
    """int32 `[B]`: each row's next token. keys: `[B]` typed keys (`row_keys`); rows with
    temperature 0 take the argmax whatever their key, top_k and top_p."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = top_p_mask(top_k_mask(scaled, top_k), top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
