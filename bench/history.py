"""bench/RESULTS.md holds the latest run of each set, newest first; every older section
moves to bench/HISTORY.md (in the order it left RESULTS.md, oldest first).

A run is a block: a `## <date> UTC - <device>, jax <version>` heading, a preamble (the
"Code:" and "Ceilings" lines) and one `### <set> (...)` section per set it measured (and
perhaps `### probes ...` notes). When a new run measures set X, the sections of X leave
the older blocks for HISTORY.md, each under its block's heading and preamble; a block left
with no set section leaves whole (its probe notes with it). Blocks with no set section at
all (ad-hoc probe write-ups) go straight to HISTORY.md. Only the newest probe notes stay in
RESULTS.md: older ones leave, under their block's heading, on the next write.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

HEADER = (
    "# Benchmark results: the latest run of each set (`python -m bench.run`)\n\n"
    "Every row was checked against the float32 reference (`jaxattn.reference`) before it was "
    "timed. Runs are newest first; the line under each heading says which code it measured. "
    "Older runs of each set, and the probe write-ups (ad-hoc scripts, not `make bench`) but "
    "the newest notes kept inside a run's block, are in `bench/HISTORY.md`.\n"
)
HISTORY_HEADER = (
    "# Benchmark history\n\n"
    "The runs of each set that a newer run replaced in `bench/RESULTS.md`, and the probe "
    "write-ups (all those written as blocks of their own, and older notes inside runs), "
    "appended in the order they left it (oldest first). A run "
    "whose sets left at different times appears once per move, under its heading.\n"
)


@dataclasses.dataclass
class Block:
    """One run: heading and preamble lines, and its `###` sections as (name, text)."""

    head: str
    sections: list[tuple[str, str]]

    @property
    def sets(self) -> set[str]:
        return {name for name, _ in self.sections if name != "probes"}

    def text(self) -> str:
        return self.head + "".join(text for _, text in self.sections)


def parse(text: str) -> list[Block]:
    """The run blocks of a results file (what comes before the first `## ` is dropped)."""
    blocks = []
    for chunk in re.split(r"^(?=## )", text, flags=re.M):
        if chunk.startswith("## "):
            head, *parts = re.split(r"^(?=### )", chunk, flags=re.M)
            blocks.append(Block(_spaced(head), [(_name(p), _spaced(p)) for p in parts]))
    return blocks


def _name(section: str) -> str:
    """A section's set name ("probes" for probe notes): `### decode (bf16, ...)` -> decode."""
    name = section[4:].split(maxsplit=1)[0].rstrip(",")
    return "probes" if name.startswith("probes") else name


def _spaced(text: str) -> str:
    """Text ending in one blank line."""
    return text.rstrip("\n") + "\n\n"


def add_run(latest: list[Block], new: Block) -> tuple[list[Block], list[Block]]:
    """(RESULTS.md's blocks with `new` on top, the blocks that leave for HISTORY.md)."""
    if not new.sets:
        return latest, [new]
    kept, leaving = [], []
    for block in latest:
        stays = [(n, t) for n, t in block.sections if n not in new.sets]
        goes = [(n, t) for n, t in block.sections if n in new.sets]
        if any(n != "probes" for n, _ in stays):
            kept.append(Block(block.head, stays))
            if goes:
                leaving.append(Block(block.head, goes))
        else:
            leaving.append(block)
    latest, old_probes = _newest_probes_only([new, *kept])
    return latest, leaving + old_probes


def _newest_probes_only(blocks: list[Block]) -> tuple[list[Block], list[Block]]:
    """(`blocks` keeping only the first (newest) probe notes, the older probe notes, each
    under its block's heading)."""
    kept, leaving, seen = [], [], False
    for block in blocks:
        probes = [(n, t) for n, t in block.sections if n == "probes"]
        if probes and seen:
            kept.append(Block(block.head, [(n, t) for n, t in block.sections if n != "probes"]))
            leaving.append(Block(block.head, probes))
        else:
            kept.append(block)
        seen = seen or bool(probes)
    return kept, leaving


def _write(path: Path, header: str, blocks: list[Block]) -> None:
    path.write_text(header + "\n" + "".join(b.text() for b in blocks).rstrip("\n") + "\n")


def write(results_md: Path, history_md: Path, section: str) -> None:
    """Adds a run's `section` (a `## ` block) to RESULTS.md, moving what it replaces."""
    latest = parse(results_md.read_text()) if results_md.exists() else []
    history = parse(history_md.read_text()) if history_md.exists() else []
    for block in parse(section):
        latest, leaving = add_run(latest, block)
        history.extend(leaving)
    _write(results_md, HEADER, latest)
    _write(history_md, HISTORY_HEADER, history)
