"""Pallas GPU kernels behind jaxattn. One subpackage per kernel: `kernel.py` + `config.py`.

Nothing here imports `jaxattn` (imports go one way: jaxattn -> pallas_kernels).
"""
