"""The notebooks in notebooks/ run top to bottom, and are committed without outputs.

Each notebook runs in a fresh kernel of this interpreter (the venv's python, whatever
kernelspecs the machine has installed) with a temporary working directory, so nothing is
written into the repository. Figures go through matplotlib's inline backend (Agg), so no
display is needed.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402 (after the skips)
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120  # a whole notebook takes ~15 s on 2 cores; a stuck cell fails here


def _kernel_env(tmp_path: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    # The repository on the path whatever the cwd (the GPU target runs with PYTHONPATH=.).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["IPYTHONDIR"] = str(tmp_path / ".ipython")  # no profile written into $HOME
    env.pop("MPLBACKEND", None)  # ipykernel then picks the inline (Agg) backend
    return env


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: pathlib.Path, tmp_path: pathlib.Path):
    nb = nbformat.read(path, as_version=4)
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    # Only the native kernelspec: ipykernel's, launched with sys.executable.
    km = AsyncKernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[])
    )
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(workdir)}}
    )
    client.execute(env=_kernel_env(tmp_path))
    assert km.kernel_spec.argv[0] == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.every_case
def test_notebook_is_stripped(path: pathlib.Path):
    """No outputs or execution counts in the repository: diffs stay small and readable."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {i} has outputs: clear them before committing"
            )
