"""examples/train.py: short tiny-size runs of its `main` must lower the held-out loss, on the
XLA reference and (2 steps, a few tokens) on the Pallas kernels' gradient path, in
interpret mode off a GPU."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train.py"


@pytest.fixture(scope="module")
def train():
    """examples/train.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("jaxattn_examples_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize(
    "argv",
    [
        ["--implementation", "xla", "--steps", "12", "--batch", "8", "--seq-len", "64"],
        ["--implementation", "pallas", "--steps", "2", "--batch", "2", "--seq-len", "16"],
    ],
    ids=["xla", "pallas"],
)
def test_loss_falls(train, argv, capsys):
    status = train.main(["--size", "tiny", *argv])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "held-out loss" in out and ": fell" in out, out
    assert "tok/s" in out, out
