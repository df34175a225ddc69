"""Several hosts: two processes (2 CPU devices each) joined by `jax.distributed` with gloo
collectives run sharded steps of the tiny Llama across the 4 devices: a tensor-parallel
forward over all of them and a data x tensor-parallel gradient (multiprocess_worker.py)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
ROOT = WORKER.parents[2]
TIMEOUT_S = 90  # about 15 s alone on 2 cores; the rest is room for a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _have_gloo() -> bool:
    from jax._src.lib import _jax  # what jax.distributed's CPU client calls for "gloo"

    return hasattr(_jax, "make_gloo_tcp_collectives")


def test_two_processes_run_a_sharded_step(tmp_path):
    if not _have_gloo():
        pytest.skip("this jaxlib has no gloo CPU collectives (make_gloo_tcp_collectives)")
    address = f"127.0.0.1:{_free_port()}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as out:  # the child keeps its own handle
            command = [sys.executable, str(WORKER), address, str(i)]
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
    # One process failing leaves the other waiting in a collective: stop at the first error.
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = [log.read_text() for log in logs]
    report = "\n".join(f"--- process {i}:\n{out[-3000:]}" for i, out in enumerate(outputs))
    for i, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, (
            f"process {i} exited {p.returncode} (limit {TIMEOUT_S} s):\n{report}"
        )
        assert f"process {i}: ok" in out, report
