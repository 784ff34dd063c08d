"""Facts about the machine that decide how fast things run: CPU model and flags, and where measured
results are cached. No dependencies, so every layer may import it."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

COMPILE_HELP = ("torch.compile the forwards (models/compiled.py): off (default: on 2 cores compiling takes minutes "
                "the first time and new step shapes recompile mid-request, BENCHMARKS.md section 9), on, or auto "
                "(compile where a measurement on this machine says it pays)")


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo, else what `platform` knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> set[str]:
    return set((_cpuinfo_field("flags") or "").split())


def cache_dir() -> Path:
    """$EAGLESPEC_CACHE_DIR, else ~/.cache/eaglespec: calibrations, precision and bandwidth measurements."""
    return Path(os.environ.get("EAGLESPEC_CACHE_DIR") or Path.home() / ".cache" / "eaglespec")


def read_cached(name: str) -> dict:
    """The measurement cache `name` (a JSON object in cache_dir()); {} when missing or unreadable, so the
    caller measures again and rewrites it."""
    path = cache_dir() / name
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def write_cached(name: str, key: str, value) -> None:
    """Add one entry to the cache `name`, re-read first (another process may have added entries) and
    written through a temporary file; a read-only home only means measuring again next time."""
    entries = read_cached(name)
    entries[key] = value
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def best_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """The fastest of `repeats` timed calls after `warmup` untimed ones: the cost without
    interference (a shared machine only ever adds time)."""
    for _ in range(warmup):
        fn()  # first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
