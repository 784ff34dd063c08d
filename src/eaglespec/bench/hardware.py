"""The machine's physical reference for the bench report: CPU name and measured memory read bandwidth.

Decoding at batch 1 reads every weight once per target forward, so the achieved weight bandwidth
(metrics.py) over this measured read bandwidth says how close a method runs to the memory roof.
The measurement (~1 s) runs once per CPU model, torch thread count and torch version, and is cached
(machine.read_cached: hardware.json in machine.cache_dir()).
"""

from __future__ import annotations

import time

import torch

from ..machine import cpu_name, read_cached, write_cached

READ_BYTES = 1 << 30  # far above any last-level cache, so the sum streams from DRAM
REPEATS = 4
CACHE = "hardware.json"  # in machine.cache_dir()
METHOD = "best of 4 torch.sum over a 1 GiB fp32 tensor at the current torch thread count"


def measure_read_bandwidth(nbytes: int = READ_BYTES, repeats: int = REPEATS) -> float:
    """GB/s (1e9 bytes) of the fastest of `repeats` sums over an fp32 tensor of `nbytes` bytes.

    A sum reads each element once and does one add per 4 bytes: memory-bound, like a batch-1
    matrix-vector product over the weights. torch.ones (not empty) so page faults happen before timing.
    """
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    x.sum()  # warm-up: thread pool start, first-touch effects
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def cache_key() -> str:
    return f"{cpu_name()} | threads={torch.get_num_threads()} | torch={torch.__version__}"


def memory_bandwidth_gbs(*, refresh: bool = False) -> float:
    """This machine's read bandwidth in GB/s, measured once per cache_key() and cached."""
    return bandwidth_reference(refresh=refresh)["read_gb_s"]


def bandwidth_reference(*, refresh: bool = False) -> dict:
    """{"read_gb_s", "method", "cpu", "threads", "torch", "cached"}: the measured (or cached) reference."""
    key = cache_key()
    entry = read_cached(CACHE).get(key) if not refresh else None
    cached = isinstance(entry, dict) and isinstance(entry.get("read_gb_s"), (int, float))
    if not cached:
        entry = {"read_gb_s": measure_read_bandwidth(), "method": METHOD,
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
        write_cached(CACHE, key, entry)  # a read-only home only loses the cache
    return {"read_gb_s": float(entry["read_gb_s"]), "method": entry.get("method", METHOD), "cpu": cpu_name(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "cached": cached}  # fmt: skip
