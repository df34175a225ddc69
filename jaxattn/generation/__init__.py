"""Generation: a continuous-batching loop over `jaxattn.models.Llama` and paged caches.

`Engine` (jitted step: prefill chunks and decode tokens in one batch, then sampling),
`Request` and its `Status`, `SamplingParams` (greedy, temperature, top-k, top-p), and
`RunStats` (throughput summary). The scheduling policy is documented in `scheduler.py`.
"""

from jaxattn.generation.engine import Engine, EngineConfig
from jaxattn.generation.progress import ProgressBar, RunStats
from jaxattn.generation.sampling import SamplingParams, sample, top_k_mask, top_p_mask
from jaxattn.generation.scheduler import Request, Status

__all__ = [
    "Engine",
    "EngineConfig",
    "ProgressBar",
    "Request",
    "RunStats",
    "SamplingParams",
    "Status",
    "sample",
    "top_k_mask",
    "top_p_mask",
]
