"""bench/RESULTS.md keeps the latest run of each set, newest first; what a run replaces
moves to bench/HISTORY.md, nothing lost (`bench.history`)."""

from __future__ import annotations

from bench import history


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
