"""Continuous batching on the host: requests, admission, and the rows of each step.

A `Request` waits until a sequence slot and its pages are free, is admitted, has its prompt
written into the cache in chunks, then generates one token per step until an end-of-sequence
token or `max_new_tokens`; its slot and pages are then released. Requests arrive and finish
at any step; a step mixes prompt chunks and generation tokens (in-flight batching).

Pages: admission commits a request's worst case, the pages of `len(prompt) +
max_new_tokens - 1` tokens (the last sampled token is never written), against the pool.
The device tables still grow step by step (`KVCacheManager.reserve` to each row's length
after the step, which `AttentionMetadata.build` reads as the row's length), so a request
that stops early at an end token holds only the pages it wrote and returns them at once.
Committing the worst case means a running request never waits for a page and nothing is
ever preempted; the price is fewer concurrent requests when `max_new_tokens` is generous.
A request waits in arrival order (first come, first served: a long request at the head of
the queue is not overtaken, so it cannot starve).

Each step's token budget goes first to one token per generating request (their latency),
then to prompt chunks in admission order: a chunk is a multiple of `page_size` (each chunk
starts on a page boundary) except a prompt's last, which may be any length. A prompt that
gets no chunk (less than a page of budget left, and more than that left of the prompt)
holds back the prompts admitted after it for the step: otherwise a stream of short
prompts could take the leftover budget step after step, start generating, and so keep a
long prompt waiting without end.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import numbers
from collections.abc import Callable, Sequence

from jaxattn.generation.sampling import SamplingParams

__all__ = ["Limits", "Request", "Scheduler", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"  # submitted; no slot or not enough pages yet
    RUNNING = "running"  # admitted: prompt being written, or generating
    FINISHED = "finished"  # `finish_reason` says why: "eos" or "length"
    REJECTED = "rejected"  # never admitted; `finish_reason` says why


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt to continue, and its state as the engine serves it.

    Args:
      prompt: token ids, at least one, each in `[0, vocab_size)`.
      max_new_tokens: tokens to generate at most (>= 1).
      eos_token_ids: generation stops after any of these (kept as the last output token).
      sampling: how tokens are picked (default greedy).
      on_token: streaming: called as `on_token(request, token)` for each new token, the
        step it is sampled.
      name: a label for printing.

    The engine commits a request's pages for its prompt and max_new_tokens when it admits
    it: neither may change after `submit` (a longer request then outgrows its pages, and
    the step that would write past them raises instead).

    Set by the engine: `status`, `finish_reason`, `output` (the generated token ids).
    """

    prompt: Sequence[int]
    max_new_tokens: int
    eos_token_ids: Sequence[int] = ()
    sampling: SamplingParams = SamplingParams()
    on_token: Callable[[Request, int], None] | None = None
    name: str = ""
    status: Status = dataclasses.field(default=Status.WAITING, init=False)
    finish_reason: str | None = dataclasses.field(default=None, init=False)
    output: list[int] = dataclasses.field(default_factory=list, init=False)
    slot: int | None = dataclasses.field(default=None, init=False, repr=False)
    prefilled: int = dataclasses.field(default=0, init=False, repr=False)
    committed: int = dataclasses.field(default=0, init=False, repr=False)  # pages, at admission

    @property
    def cached(self) -> int:
        """Tokens in the cache: the prompt written so far, then every output token but
        the newest (written by the step that feeds it back)."""
        return self.prefilled + max(len(self.output) - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def max_cached(self) -> int:
        """Cache tokens the request may need: all but its last possible token."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclasses.dataclass(frozen=True)
class Limits:
    """The static sizes the scheduler plans within.

    max_tokens: tokens per step (the largest token bucket). max_seqs: requests running at
    once (manager rows, and rows of every step). page_size, num_pages, max_pages_per_seq:
    the cache and the manager's table width. vocab_size: valid token ids.
    """

    max_tokens: int
    max_seqs: int
    page_size: int
    num_pages: int
    max_pages_per_seq: int
    vocab_size: int

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


def _rejection(request: Request, limits: Limits) -> str | None:
    """Why `request` can never be served within `limits` (None: it can)."""
    prompt = list(request.prompt)
    if not prompt:
        return "empty prompt"
    if any(not isinstance(t, numbers.Integral) or not 0 <= t < limits.vocab_size for t in prompt):
        return f"prompt token ids must be ints in [0, {limits.vocab_size})"
    if not isinstance(request.max_new_tokens, numbers.Integral) or request.max_new_tokens < 1:
        return f"max_new_tokens={request.max_new_tokens!r} must be an int >= 1"
    need, pages = request.max_cached, limits.pages(request.max_cached)
    capacity = limits.max_pages_per_seq * limits.page_size
    if need > capacity:
        return (
            f"prompt {len(prompt)} + max_new_tokens {request.max_new_tokens} needs {need} cached "
            f"tokens; a sequence holds {capacity} (max_pages_per_seq={limits.max_pages_per_seq} "
            f"x page_size={limits.page_size})"
        )
    if pages > limits.num_pages:
        return f"needs {pages} pages; the cache has {limits.num_pages}"
    return None


class Scheduler:
    """Waiting queue, running requests, slots and the page commitment (host state only;
    the engine runs the steps)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_slots = list(range(limits.max_seqs))
        self.committed_pages = 0
        self.to_release: list[int] = []  # slots of finished requests, freed by the next step

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def pages_in_use(self) -> int:
        """Pages the running requests hold on the device now."""
        return self.pages_after([])

    def pages_after(self, rows: list[tuple[Request, int]]) -> int:
        """Pages the running requests hold once a step of `rows` has written its tokens."""
        new = dict(rows)
        return sum(self.limits.pages(r.cached + new.get(r, 0)) for r in self.running)

    def submit(self, request: Request) -> bool:
        """Queues `request`, or rejects it (status REJECTED, `finish_reason` why) if it
        can never fit. Returns whether it was queued."""
        if (
            request.status is not Status.WAITING
            or request.slot is not None
            or (request in self.waiting)
        ):
            raise ValueError(f"submit: request {request.name!r} was already submitted")
        reason = _rejection(request, self.limits)
        if reason is not None:
            request.status, request.finish_reason = Status.REJECTED, reason
            return False
        self.waiting.append(request)
        return True

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            pages = self.limits.pages(self.waiting[0].max_cached)
            if self.committed_pages + pages > self.limits.num_pages:
                return
            request = self.waiting.popleft()
            request.status, request.slot = Status.RUNNING, self.free_slots.pop(0)
            request.committed = pages
            self.committed_pages += pages
            self.running.append(request)

    def schedule(self) -> list[tuple[Request, int]]:
        """Admits what fits, then the step's rows `(request, new tokens)`: one token per
        generating request, then prompt chunks while the token budget lasts."""
        self._admit()
        budget = self.limits.max_tokens
        rows = [(r, 1) for r in self.running if not r.prefilling]
        budget -= len(rows)
        for r in self.running:
            if not r.prefilling:
                continue
            remaining = len(r.prompt) - r.prefilled
            page_size = self.limits.page_size
            n = remaining if remaining <= budget else budget // page_size * page_size
            if not n:  # no overtaking: later prompts wait behind this one (module doc)
                break
            rows.append((r, n))
            budget -= n
        return rows

    def complete(self, rows: list[tuple[Request, int]], sampled: Sequence[int]):
        """Records a step: rows as `schedule` gave them, `sampled[i]` the token sampled
        from row i's last new token. Returns `(request, token)` for each new output token
        (a row that wrote a prompt chunk but not its end has none); finishes requests."""
        events = []
        for (r, n), token in zip(rows, sampled, strict=True):
            if r.prefilling:
                r.prefilled += n
                if r.prefilling:
                    continue
            token = int(token)
            r.output.append(token)
            events.append((r, token))
            if token in r.eos_token_ids:
                self._finish(r, "eos")
            elif len(r.output) == r.max_new_tokens:
                self._finish(r, "length")
        return events

    def _finish(self, request: Request, reason: str) -> None:
        request.status, request.finish_reason = Status.FINISHED, reason
        self.running.remove(request)
        self.to_release.append(request.slot)
        self.free_slots.append(request.slot)
        self.free_slots.sort()
        self.committed_pages -= request.committed  # what admission counted, not max_cached now
