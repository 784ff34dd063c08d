"""Drift verdicts (explicit criteria), the JSON report, plots and the text summary.

Criteria, comparing depth D (the deepest) with depth 1:
- attention drift: the mass on the sink tokens falls by at least SINK_FALL (relative), i.e.
  sink(D) <= (1 - SINK_FALL) * sink(1). Not judged when sink(1) < MIN_SINK (no sink to lose).
- state growth: the fed-back state's RMS grows by at least RMS_GROWTH, fed_back_rms(D) / fed_back_rms(1).
A drafter meeting neither is "stable".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from .measure import DepthProfile

SINK_FALL = 0.3
RMS_GROWTH = 1.5
MIN_SINK = 0.02


@dataclass
class Verdict:
    sink_fall: float | None  # relative fall of sink mass from depth 1 to D (None: no sink at depth 1)
    rms_growth: float
    attention_drift: bool
    state_growth: bool

    @property
    def conclusion(self) -> str:
        if self.attention_drift:
            return "attention drift" + (" (the fed-back state grows)" if self.state_growth else "")
        if self.state_growth:
            return "the fed-back state grows but sink attention holds"
        return "stable"

    def to_dict(self) -> dict:
        return {**asdict(self), "conclusion": self.conclusion}


def judge(p: DepthProfile) -> Verdict:
    s1, sd = p.sink_mass[0], p.sink_mass[-1]
    fall = None if s1 < MIN_SINK else 1.0 - sd / s1
    growth = p.fed_back_rms[-1] / max(p.fed_back_rms[0], 1e-12)
    return Verdict(fall, growth, fall is not None and fall >= SINK_FALL, growth >= RMS_GROWTH)


def verdict_line(p: DepthProfile) -> str:
    v, d = judge(p), p.depth
    sink = f"sink mass {p.sink_mass[0]:.2f} at depth 1 -> {p.sink_mass[-1]:.2f} at depth {d}"
    if v.sink_fall is None:
        sink += " (no sink attention at depth 1)"
    return (
        f"{p.label}: {sink}, own-token mass {p.own_mass[-1]:.2f} at depth {d} (uniform share "
        f"{p.own_uniform[-1]:.2f}), fed-back RMS {p.fed_back_rms[0]:.2f} -> {p.fed_back_rms[-1]:.2f} "
        f"({v.rms_growth:.1f}x), acceptance at depth {d} {p.acceptance[-1]:.2f}, mean accepted length "
        f"{p.mean_accepted_length:.2f} over {p.chains} chains: {v.conclusion}."
    )


def summary_text(profiles: list[DepthProfile]) -> str:
    lines = [verdict_line(p) for p in profiles]
    if len(profiles) > 1:
        taus = ", ".join(f"{p.label} {p.tau:.2f}" for p in profiles)
        lines.append(f"tau (1 + mean accepted length): {taus}; first / second {profiles[0].tau / profiles[1].tau:.2f}x")
    lines.append(
        f"criteria: attention drift = sink mass falls >= {SINK_FALL:.0%} from depth 1 to the deepest; "
        f"state growth = fed-back RMS grows >= {RMS_GROWTH}x"
    )
    return "\n".join(lines) + "\n"


def table_markdown(profiles: list[DepthProfile]) -> str:
    """One row per drafter and depth: the numbers behind the plots."""
    rows = ["| drafter | depth | sink | context | own | own if uniform | fed-back RMS | pre-norm RMS | acceptance |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for p in profiles:
        for d in range(p.depth):
            rows.append(
                f"| {p.label} | {d + 1} | {p.sink_mass[d]:.3f} | {p.context_mass[d]:.3f} | {p.own_mass[d]:.3f} | "
                f"{p.own_uniform[d]:.3f} | {p.fed_back_rms[d]:.2f} | {p.prenorm_rms[d]:.2f} | {p.acceptance[d]:.3f} |"
            )
    return "\n".join(rows) + "\n"


class Plot(NamedTuple):
    title: str
    ylabel: str
    series: list[tuple[str, str]]  # (DepthProfile field, label suffix): solid line, then dashed
    fraction: bool  # y in [0, 1]


PLOTS = {  # file name -> plot
    "sink_mass": Plot("Attention mass on the sink tokens", "mass", [("sink_mass", "")], True),
    "own_mass": Plot("Attention mass on own drafted tokens", "mass",
                     [("own_mass", ""), ("own_uniform", " (uniform share)")], True),
    "fed_back_rms": Plot("RMS of the hidden state", "RMS",
                         [("fed_back_rms", " fed back"), ("prenorm_rms", " pre-norm")], False),
    "acceptance": Plot("Acceptance (first d drafts all correct)", "fraction of chains", [("acceptance", "")], True),
}  # fmt: skip


def _draw(ax, profiles: list[DepthProfile], plot: Plot) -> None:
    for i, p in enumerate(profiles):
        depths = range(1, p.depth + 1)
        for j, (field, suffix) in enumerate(plot.series):
            ax.plot(depths, getattr(p, field), color=f"C{i}", linestyle=["-", "--"][j], marker="o" if j == 0 else None,
                    label=p.label + suffix)  # fmt: skip
    ax.set_title(plot.title)
    ax.set_xlabel("draft depth")
    ax.set_ylabel(plot.ylabel)
    if plot.fraction:
        ax.set_ylim(0, 1.02)
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write_plots(profiles: list[DepthProfile], out: Path) -> list[Path]:
    """One PNG per metric plus a 2x2 overview, every drafter on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, plot in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        _draw(ax, profiles, plot)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=72)
        plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, plot in zip(axes.flat, PLOTS.values()):
        _draw(ax, profiles, plot)
    fig.tight_layout()
    paths.append(out / "drift.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)
    return paths


def write_report(profiles: list[DepthProfile], out, settings: dict) -> str:
    """drift.json, verdict.txt, table.md and the plots under `out`; returns the verdict text."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = summary_text(profiles)
    report = {
        "settings": settings,
        "criteria": {"sink_fall": SINK_FALL, "rms_growth": RMS_GROWTH, "min_sink": MIN_SINK},
        "drafters": [{**p.to_dict(), "verdict": judge(p).to_dict()} for p in profiles],
    }
    (out / "drift.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "verdict.txt").write_text(text)
    (out / "table.md").write_text(table_markdown(profiles))
    write_plots(profiles, out)
    return text
