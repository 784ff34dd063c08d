"""Per method and category: throughput, tau, acceptance, latency percentiles, time split, memory, bandwidth.

Definitions (the JSON keeps full precision; tables round):
  tokens_per_s   new tokens / wall seconds of the method's run over the category's prompts
  tau            ours: 1 + accepted / drafts (vLLM); peers: new tokens / target forwards (tokens per
                 verification forward, which equals 1 + accepted / rounds for assisted decoding)
  speedup        tokens_per_s / plain's tokens_per_s on the same prompts; efficiency = speedup / tau
  latency        per request (admission to finish) p50/p90/p99; per-token = request latency / its tokens
  bandwidth      bytes of target weights read per forward x target forwards / wall (gpt-fast style);
                 bandwidth_pct = that as a percentage of the machine's measured read bandwidth (hardware.py)
  peak_rss_mb    the process's resident-set high-water mark during this run (VmHWM, reset before the run
                 through /proc/self/clear_refs); it includes everything resident (all loaded models).
                 rss_increase_mb = peak - RSS at the start of the run: this method's working memory
                 (KV cache, activations, temporaries). Without clear_refs: getrusage ru_maxrss, which is
                 the lifetime peak (memory_source says which).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..stats import SpecStats, aggregate


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRSS:
    """with PeakRSS() as m: ...  -> m.peak_mb, m.before_mb, m.source."""

    def __enter__(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
            self.source = "VmHWM (reset per run)"
        except OSError:
            self.source = "ru_maxrss (process lifetime)"
        self.before_mb = (_status_kb("VmRSS") or 0) / 1024
        return self

    def __exit__(self, *exc):
        hwm = _status_kb("VmHWM") if self.source.startswith("VmHWM") else None
        if hwm is None:
            ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            hwm = ru / 1024 if sys.platform == "darwin" else ru  # bytes on macOS, KiB on Linux
            self.source = "ru_maxrss (process lifetime)"
        self.peak_mb = hwm / 1024
        return False


@dataclass
class Measurement:
    """One method's run over one category's prompts."""

    outputs: list[list[int]]
    latencies: list[float]
    target_forwards: int
    wall_s: float
    stats: SpecStats | None = None
    peak_rss_mb: float = 0.0
    rss_before_mb: float = 0.0
    memory_source: str = ""
    prompt_ids: list[str] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def combine(ms: list[Measurement]) -> Measurement:
    """All categories of one method as one measurement (runs were sequential: walls add up)."""
    stats = [m.stats for m in ms if m.stats is not None]
    return Measurement(
        outputs=[o for m in ms for o in m.outputs],
        latencies=[x for m in ms for x in m.latencies],
        target_forwards=sum(m.target_forwards for m in ms),
        wall_s=sum(m.wall_s for m in ms),
        stats=aggregate(stats) if stats else None,
        peak_rss_mb=max(m.peak_rss_mb for m in ms),
        rss_before_mb=min(m.rss_before_mb for m in ms),
        memory_source=ms[0].memory_source,
        prompt_ids=[p for m in ms for p in m.prompt_ids],
    )


def percentiles(values: list[float], scale: float = 1.0) -> dict | None:
    if not values:
        return None
    p = np.percentile(np.asarray(values, dtype=float) * scale, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def summarize(method, category: str, m: Measurement) -> dict:
    """The metrics of one (method, category); speedup and efficiency are filled in by add_speedups."""
    s = m.stats
    new = m.new_tokens
    if s is not None:
        depth = method.settings.get("chain_k") or method.settings.get("tree_depth") or 0
        tau, per_pos = s.tau, s.per_position_acceptance
        per_pos = per_pos + [0.0] * (depth - len(per_pos)) if s.drafts else per_pos
        tau_def = "1 + accepted / drafts"
        split = {"prefill": s.time_prefill, "draft": s.time_draft, "verify": s.time_verify, "other": s.time_other}
        counts = {"drafts": s.drafts, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted}
    else:
        tau = new / m.target_forwards if m.target_forwards else None
        per_pos, tau_def, split = None, "new tokens / target forwards", None
        counts = {"drafts": None, "draft_tokens": None, "accepted_tokens": None}
    per_token = [lat / len(o) for lat, o in zip(m.latencies, m.outputs) if o]
    return {
        "method": method.name, "kind": method.kind, "category": category, "lossless": method.lossless,
        "prompts": len(m.outputs), "new_tokens": new, "wall_s": m.wall_s,
        "tokens_per_s": new / m.wall_s if m.wall_s > 0 else 0.0,
        "tau": tau, "tau_definition": tau_def, **counts, "per_position_acceptance": per_pos,
        "speedup": None, "efficiency": None,
        "latency_s": percentiles(m.latencies), "per_token_latency_ms": percentiles(per_token, 1000.0),
        "time_split_s": split, "target_forwards": m.target_forwards,
        "weight_bytes_per_forward": method.weight_bytes,
        "bandwidth_gb_s": method.weight_bytes * m.target_forwards / m.wall_s / 1e9 if m.wall_s > 0 else 0.0,
        "weights_mb": method.resident_bytes / 2**20,
        "peak_rss_mb": m.peak_rss_mb, "rss_increase_mb": max(0.0, m.peak_rss_mb - m.rss_before_mb),
        "memory_source": m.memory_source,
    }  # fmt: skip


def add_speedups(rows: list[dict], baseline: str = "plain") -> None:
    """speedup = tokens/s / the baseline's tokens/s in the same category; efficiency = speedup / tau."""
    base = {r["category"]: r["tokens_per_s"] for r in rows if r["method"] == baseline}
    for r in rows:
        b = base.get(r["category"])
        if b:
            r["speedup"] = r["tokens_per_s"] / b
            r["efficiency"] = r["speedup"] / r["tau"] if r["tau"] else None


def add_bandwidth_share(rows: list[dict], read_gb_s: float) -> None:
    """bandwidth_pct = achieved weight bandwidth as a percentage of the measured memory read bandwidth."""
    for r in rows:
        r["bandwidth_pct"] = 100.0 * r["bandwidth_gb_s"] / read_gb_s if read_gb_s > 0 else None
