"""Benchmarks of jaxattn against its peers: `python -m bench.run` (see bench/README.md)."""
