"""Reporting of a generation run: a plain-text progress bar and the throughput summary."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "RunStats"]


class ProgressBar:
    """One line redrawn in place: `[#######---------]  7/16 requests  step 40  512 tok/s`.

    Redraws at most every `min_interval_s` (and on `close`), so a fast loop does not spend
    its time printing.
    """

    def __init__(
        self, total: int, *, stream: TextIO | None = None, width: int = 24, min_interval_s=0.1
    ):
        self.total, self.width, self.min_interval_s = total, width, min_interval_s
        self.stream = sys.stderr if stream is None else stream
        self._last = -float("inf")
        self._line = ""

    def update(self, done: int, note: str = "", *, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        filled = self.width * done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {done:>{len(str(self.total))}}/{self.total} requests  {note}"
        if line == self._line:
            return
        self.stream.write("\r" + line.ljust(len(self._line)))
        self.stream.flush()
        self._line = line

    def close(self, done: int, note: str = "") -> None:
        self.update(done, note, force=True)
        self.stream.write("\n")
        self.stream.flush()


@dataclasses.dataclass
class RunStats:
    """Counters of an engine since its creation.

    steps: serving steps run; compilations: traces of the jitted step (one per bucket
    used); buckets_used: the buckets of those steps, `(tokens, decode_only)`: the token
    bucket, and whether the step had generation rows only (a plan of its own, see
    `jaxattn.AttentionMetadata.decode_only`); prompt_tokens and
    generated_tokens: tokens written from prompts, and sampled; finished, rejected:
    requests; peak_pages: most cache pages held at once (of num_pages); wall_s: time in
    steps; compile_s: the part of it spent in steps that compiled.
    """

    num_pages: int
    steps: int = 0
    compilations: int = 0
    buckets_used: set[tuple[int, bool]] = dataclasses.field(default_factory=set)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    rejected: int = 0
    peak_pages: int = 0
    wall_s: float = 0.0
    compile_s: float = 0.0

    def record_step(
        self, *, bucket, prompt_tokens, generated, finished, pages, seconds, compiled
    ) -> None:
        """Counts one step: its bucket `(tokens, decode_only)`, prompt tokens written,
        tokens sampled, requests finished, pages held after it, its time, and whether it
        compiled."""
        self.steps += 1
        self.buckets_used.add(bucket)
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated
        self.finished += finished
        self.peak_pages = max(self.peak_pages, pages)
        self.wall_s += seconds
        self.compile_s += seconds if compiled else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of stepping, compiling steps included."""
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def warm_tokens_per_s(self) -> float:
        """Generated tokens per second of the steps that did not compile."""
        warm = self.wall_s - self.compile_s
        return self.generated_tokens / warm if warm > 0 else 0.0

    def __str__(self) -> str:
        return "\n".join(
            [
                f"requests: {self.finished} finished, {self.rejected} rejected",
                f"tokens: {self.prompt_tokens} prompt, {self.generated_tokens} generated "
                f"in {self.steps} steps",
                f"throughput: {self.tokens_per_s:.1f} generated tokens/s over {self.wall_s:.2f} s"
                f" ({self.warm_tokens_per_s:.1f} tokens/s without the {self.compile_s:.2f} s "
                "of compiling steps)",
                f"peak pages in use: {self.peak_pages} of {self.num_pages}",
                f"compilations: {self.compilations} (buckets used: "
                + ", ".join(
                    f"{t}" + (" decode-only" if d else "") for t, d in sorted(self.buckets_used)
                )
                + ")",
            ]
        )
