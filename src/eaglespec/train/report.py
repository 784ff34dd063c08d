"""What a run reports: console lines, metrics.jsonl records (train and eval), per-TTT-step accuracy from
the loss's counts, and plots/{loss,step_accuracy,tau}.png drawn from metrics.jsonl."""

from __future__ import annotations

import json
import time
from pathlib import Path


def say(msg: str) -> None:
    print(f"[eaglespec train] {msg}", flush=True)


def append_record(out: Path, rec: dict, *, progress: bool) -> None:
    """Append `rec` (with the time) to out/metrics.jsonl and print it: eval records always, train records
    when there is no progress bar."""
    out.mkdir(parents=True, exist_ok=True)
    rec = {**rec, "time": round(time.time(), 1)}
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    if rec["kind"] == "eval":
        acc = rec.get("val_step_accuracy") or []
        say(f"step {rec['step']}: val_loss {rec.get('val_loss', float('nan')):.4f} "
            f"acc {[round(a, 3) for a in acc]} tau {rec.get('tau', float('nan')):.3f}")  # fmt: skip
    elif not progress:
        say(f"step {rec['step']}: loss {rec['loss']:.4f} lr {rec['lr']:.2e} {rec['tokens_per_s']:.0f} tok/s")


def truncate_records(out: Path, step: int) -> None:
    """Drop the records after `step` (a resumed run repeats those steps, and curves must not)."""
    log = out / "metrics.jsonl"
    if log.is_file():
        keep = [ln for ln in log.read_text().splitlines() if json.loads(ln).get("step", 0) <= step]
        log.write_text("".join(ln + "\n" for ln in keep))


# -- accuracy per TTT step: ttt_loss counts {"correct", "count"} per step -------------------------------
def merge_stats(acc: list[dict] | None, stats: list[dict]) -> list[dict]:
    """Add `stats` into `acc` (None: a copy of `stats`)."""
    if acc is None:
        return [{"correct": s["correct"], "count": s["count"]} for s in stats]
    for a, s in zip(acc, stats):
        a["correct"] += s["correct"]
        a["count"] += s["count"]
    return acc


def sum_stats(items: list[list[dict]]) -> list[dict] | None:
    out = None
    for s in items:
        out = merge_stats(out, s)
    return out


def accuracy(stats: list[dict]) -> list[float]:
    return [s["correct"] / s["count"] if s["count"] else 0.0 for s in stats]


# -- plots ------------------------------------------------------------------------------------------
def plot_metrics(metrics_file, out_dir) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(ln) for ln in Path(metrics_file).read_text().splitlines() if ln.strip()]
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval" and "val_loss" in r]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="held-out")
    ax.set(xlabel="step", ylabel="TTT loss (sum over steps, decayed)", title="drafter loss")
    ax.legend()
    paths.append(out_dir / "loss.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    if evals:
        fig, ax = plt.subplots(figsize=(6, 4))
        acc = [r["val_step_accuracy"] for r in evals]
        for k in range(len(acc[0])):
            ax.plot([r["step"] for r in evals], [a[k] for a in acc], label=f"TTT step {k}")
        ax.set(xlabel="step", ylabel="held-out accuracy (top-1 = target argmax)", title="accuracy per TTT step")
        ax.legend(fontsize=7)
        paths.append(out_dir / "step_accuracy.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
        taus = [r for r in evals if "tau" in r]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in taus], [r["tau"] for r in taus], "o-")
        ax.set(xlabel="step", ylabel="tau (mean acceptance length)", title="real tau on held-out prompts")
        paths.append(out_dir / "tau.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return paths
