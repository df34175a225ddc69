"""bench/RESULTS.md keeps the latest run of each set, newest first; what a run replaces
moves to bench/HISTORY.md, nothing lost (`bench.history`)."""

from __future__ import annotations

import json

from bench import history, report
from bench.common import Ceilings, Row, SetResult, Settings


def _run(time: str, *sets: str, probes: bool = False) -> str:
    text = f"## 2026-11-24 {time} UTC - GPU, jax 0\n\nCode: at {time}.\n\n"
    for name in sets:
        text += f"### {name} (shapes)\n\n| row | {name} at {time} |\n\n"
    if probes:
        text += f"### probes of {time} (notes)\n\nprobe text {time}\n\n"
    return text


def test_latest_run_of_each_set_first_and_the_rest_in_history(tmp_path):
    results, past = tmp_path / "RESULTS.md", tmp_path / "HISTORY.md"
    history.write(results, past, _run("10:00", "prefill", "decode", probes=True))
    history.write(results, past, _run("11:00", "decode"))
    history.write(results, past, _run("12:00", "train"))

    text = results.read_text()
    assert text.startswith(history.HEADER)
    order = [text.index(f"## 2026-11-24 {t} UTC") for t in ("12:00", "11:00", "10:00")]
    assert order == sorted(order)  # newest first
    assert "| prefill at 10:00 |" in text and "probe text 10:00" in text
    assert "| decode at 10:00 |" not in text and "| decode at 11:00 |" in text
    old = past.read_text()
    assert "| decode at 10:00 |" in old and "Code: at 10:00." in old  # with its preamble

    # A new prefill run empties the 10:00 block: it leaves whole, its probe notes too.
    history.write(results, past, _run("13:00", "prefill"))
    text, old = results.read_text(), past.read_text()
    assert "10:00" not in text
    assert "| prefill at 10:00 |" in old and "probe text 10:00" in old
    assert old.index("| decode at 10:00 |") < old.index("| prefill at 10:00 |")  # oldest first
    blocks = history.parse(text)
    assert [sorted(b.sets) for b in blocks] == [["prefill"], ["train"], ["decode"]]


def test_a_probe_only_block_goes_to_history(tmp_path):
    results, past = tmp_path / "RESULTS.md", tmp_path / "HISTORY.md"
    history.write(results, past, _run("10:00", "decode"))
    history.write(results, past, "## 2026-11-24 probes - GPU\n\nad-hoc table\n")
    assert "ad-hoc table" not in results.read_text()
    assert "ad-hoc table" in past.read_text()


def test_only_the_newest_probe_notes_stay(tmp_path):
    results, past = tmp_path / "RESULTS.md", tmp_path / "HISTORY.md"
    history.write(results, past, _run("10:00", "prefill", probes=True))
    history.write(results, past, _run("11:00", "decode", probes=True))
    text, old = results.read_text(), past.read_text()
    assert "probe text 11:00" in text and "| prefill at 10:00 |" in text
    assert "probe text 10:00" not in text
    assert "probe text 10:00" in old and "Code: at 10:00." in old
    assert "| prefill at 10:00 |" not in old


def test_write_results_moves_replaced_sets_and_merges_results_json(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(report, "_plot", lambda *args: None)
    settings = Settings(False, 3, 1, False, None, Ceilings(700.0, 8192, 3.0, 2**30))

    def write(time, *names):
        results = [
            SetResult(n, "shapes", [Row(n, f"{n} at {time}", "ours", "ok", 1.0)]) for n in names
        ]
        metadata = {"date": f"2026-11-24 {time} UTC", "device": "GPU", "jax_version": "0"}
        report.write_results(
            results, settings, metadata, report.format_section(results, settings, metadata)
        )

    write("10:00", "prefill", "decode")
    write("11:00", "decode")
    text, old = (tmp_path / "RESULTS.md").read_text(), (tmp_path / "HISTORY.md").read_text()
    assert text.index("2026-11-24 11:00 UTC") < text.index("2026-11-24 10:00 UTC")
    assert "decode at 11:00" in text and "prefill at 10:00" in text
    assert "decode at 10:00" not in text and "decode at 10:00" in old
    sets = json.loads((tmp_path / "results.json").read_text())["sets"]
    assert {s["name"]: s["run"]["date"][11:16] for s in sets} == {
        "prefill": "10:00",
        "decode": "11:00",
    }
