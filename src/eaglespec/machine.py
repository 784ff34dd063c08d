"""Facts about the machine that decide how fast things run: CPU model and flags, and where measured
results are cached. No dependencies, so every layer may import it."""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
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
    """$EAGLESPEC_CACHE_DIR, else $XDG_CACHE_HOME/eaglespec (default ~/.cache/eaglespec): every measurement
    cache (calibrated step costs, precision, compile and int8-kernel choices, memory bandwidth, settings
    tuned by `bench --auto`) and the `bench --shape` models."""
    env = os.environ.get("EAGLESPEC_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eaglespec"


def cache_file(name: str | os.PathLike) -> Path:
    """Where the measurement cache `name` lives: a file name is a file in cache_dir(); a path object is
    used as it is (a caller's own file: a test's, $EAGLESPEC_TUNED_FILE)."""
    return Path(name) if isinstance(name, os.PathLike) else cache_dir() / name


def read_cached(name: str | os.PathLike, *, what: str | None = None) -> dict:
    """The measurement cache `name` (a JSON object, cache_file(name)); {} when missing or unreadable, so
    the caller measures again and rewrites it. `what` names the cache in a warning about an unreadable
    file (else it is ignored silently)."""
    path = cache_file(name)
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        if what is not None:
            warnings.warn(f"ignoring unreadable {what} cache {path} ({e}); it will be rebuilt", stacklevel=3)
        return {}
    return raw


def write_cached(name: str | os.PathLike, key: str, value) -> OSError | None:
    """Add one entry to the cache `name`, re-read first (another process may have added entries) and
    written through a temporary file (readers never see half a file). Returns the error that kept it
    from being written, or None: for most caches a read-only home only means measuring again next time."""
    path = cache_file(name)
    entries = read_cached(path)
    entries[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        return e
    return None


def cpu_steal_counters() -> tuple[int, int] | None:
    """(steal, total) CPU time of all CPUs so far, in clock ticks, from /proc/stat; None where there is none.
    Steal is time a VM's host gave to other guests: a benchmark interval with much of it ran on a slower machine."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen between two cpu_steal_counters() readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


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
