"""Several hosts: two processes (2 CPU devices each) joined by `jax.distributed` with gloo
collectives run one sharded attention step across the 4 devices (multiprocess_worker.py)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
ROOT = WORKER.parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_run_a_sharded_step():
    address = f"127.0.0.1:{_free_port()}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=str(ROOT),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-4000:]}"
        assert f"process {i}: ok" in out
