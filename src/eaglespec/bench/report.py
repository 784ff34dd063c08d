"""Write a bench or sweep report: JSON (everything), Markdown (tables), PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def fmt(x, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def table(headers: list[str], rows: list[list[str]], align_left: int = 1) -> str:
    head = "| " + " | ".join(headers) + " |"
    rule = "|" + "|".join("---" if i < align_left else "---:" for i in range(len(headers))) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(r) + " |" for r in rows])


def lossless_lines(check: dict) -> list[str]:
    if not check["applicable"]:
        return [f"Lossless check: not applicable ({check['reason']})."]
    ref = check["reference"]
    if check["passed"]:
        lines = [f"Lossless check: **PASSED** - greedy outputs of {', '.join(check['methods'])} are identical to "
                 f"`{ref}` ({check['compared']} outputs compared over their common length)."]  # fmt: skip
    else:
        lines = [f"Lossless check: **FAILED** - {len(check['mismatches'])} output(s) differ from `{ref}`:", ""]
        lines += [f"- {x['method']} on {x['category']} prompt `{x['prompt_id']}`: first differing position "
                  f"{x['position']} (expected token {x['expected']}, got {x['got']})"
                  for x in check["mismatches"]]  # fmt: skip
    if check["length_differences"]:
        lines.append(f"Length differences with identical common prefix (stopping, not a mismatch): "
                     f"{len(check['length_differences'])}.")  # fmt: skip
    return lines


def summary_table(rows: list[dict]) -> str:
    total = [r for r in rows if r["category"] == "all"]
    headers = ["method", "tok/s", "speedup", "tau", "efficiency", "accept@1..4", "latency p50/p90/p99 s",
               "ms/token p50", "draft/verify/other s", "peak RSS MB", "+RSS MB", "weights GB/s"]  # fmt: skip
    share = any(r.get("bandwidth_pct") is not None for r in total)  # only when the bench measured the machine
    if share:
        headers.append("% of mem BW")
    body = []
    for r in total:
        pos = r["per_position_acceptance"]
        acc = " ".join(f"{x:.2f}" for x in pos[:4]) if pos else "-"
        lat = r["latency_s"]
        split = r["time_split_s"]
        body.append([
            r["method"], fmt(r["tokens_per_s"], 1), fmt(r["speedup"], 2, "x"), fmt(r["tau"]), fmt(r["efficiency"]),
            acc, "/".join(fmt(lat[k]) for k in ("p50", "p90", "p99")), fmt(r["per_token_latency_ms"]["p50"], 1),
            "-" if split is None else "/".join(fmt(split[k]) for k in ("draft", "verify", "other")),
            fmt(r["peak_rss_mb"], 0), fmt(r["rss_increase_mb"], 0), fmt(r["bandwidth_gb_s"], 2),
        ] + ([fmt(r.get("bandwidth_pct"), 1, "%")] if share else []))  # fmt: skip
    return table(headers, body)


def method_line(m: dict) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in m["settings"].items()) or "no settings"
    note = "" if m.get("lossless", True) else " (**not lossless**)"
    if "synthetic_acceptance" in m["settings"]:
        note = " (**synthetic acceptance, not lossless**)"
    return f"- `{m['name']}`{note}: {settings}"


def reference_lines(report: dict) -> list[str]:
    """The measured memory bandwidth and the synthetic-acceptance note, when the run has them."""
    lines = []
    shape = report.get("shape")
    if shape:
        lines.append(f"Target: built-in shape `{shape['name']}` ({shape['note']}, {shape['params'] / 1e6:.1f}M "
                     f"parameters, draft vocabulary {shape['draft_vocab']}), {shape['weights']}; prompts are "
                     "random token ids.")  # fmt: skip
    bw = report.get("memory_bandwidth")
    if bw:
        lines.append(f"Memory read bandwidth: {bw['read_gb_s']:.1f} GB/s measured on this machine ({bw['method']}); "
                     "`% of mem BW` = achieved target-weight bandwidth / this.")  # fmt: skip
    if report.get("synthetic_acceptance"):
        lines.append(f"Synthetic acceptance {report['synthetic_acceptance']} (per position): speculative rows accept "
                     "by this profile, not by the target - synthetic acceptance, not lossless, left out of the "
                     "lossless check; their tokens/s is the cost at that acceptance.")  # fmt: skip
    return lines


def matrix(rows: list[dict], key: str, digits: int = 2) -> str:
    cats = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["category"]): r[key] for r in rows}
    return table(["method", *cats], [[m, *(fmt(cell.get((m, c)), digits) for c in cats)] for m in methods])


def bench_markdown(report: dict) -> str:
    cfg, env = report["config"], report["environment"]
    lines = ["# eaglespec bench", ""]
    if report.get("command"):
        lines += ["```bash", report["command"], "```", ""]
    lines += [
        f"target `{report.get('target', '?')}`; {cfg['max_new_tokens']} new tokens per prompt, batch "
        f"{cfg['batch_size']} (peers: 1), temperature {cfg['temperature']}; prompts per category: "
        + ", ".join(f"{k} {v}" for k, v in cfg["prompts_per_category"].items()) + ".",
        f"torch {env['torch']}, transformers {env['transformers']}, torch threads: {env['threads']}, {env['cpu']}.",
        "",
        *lossless_lines(report["lossless_check"]),
        *reference_lines(report),
        "",
        "Methods:",
        *(method_line(m) for m in report["methods"]),
        "",
        "## All categories",
        "",
        summary_table(report["results"]),
        "",
        "## tokens/s by category", "", matrix(report["results"], "tokens_per_s", 1), "",
        "## tau by category", "", matrix(report["results"], "tau"), "",
        "## speedup over plain by category", "", matrix(report["results"], "speedup"), "",
        "Definitions: see `src/eaglespec/bench/metrics.py` (tau of peers = new tokens / target forwards; peak RSS",
        "= process VmHWM during the method's run, +RSS = above the RSS at its start).",
    ]  # fmt: skip
    if report.get("skipped"):
        lines += ["", f"Skipped prompts (too long for the context): {len(report['skipped'])}."]
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(rows: list[dict], key: str, ylabel: str, path: Path) -> None:
    import numpy as np

    plt = _plt()
    cats = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["category"]): r[key] or 0.0 for r in rows}
    x = np.arange(len(cats))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cats)), 4))
    for i, m in enumerate(methods):
        ax.bar(x + i * width, [cell.get((m, c), 0.0) for c in cats], width, label=m)
    ax.set_xticks(x + width * (len(methods) - 1) / 2, cats, rotation=20)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_plot(rows: list[dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in rows:
        if r["category"] == "all" and r["per_position_acceptance"]:
            pos = r["per_position_acceptance"]
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=r["method"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (drafts with >= i accepted)")
    ax.set_ylim(0, 1.05)
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speculative method ran", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def time_split_plot(rows: list[dict], path: Path) -> None:
    plt = _plt()
    ours = [r for r in rows if r["category"] == "all" and r["time_split_s"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(ours)
    for part in ("prefill", "draft", "verify", "other"):
        vals = [r["time_split_s"][part] for r in ours]
        ax.bar([r["method"] for r in ours], vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds (all categories)")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_bench(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "bench.json")
    (out / "bench.md").write_text(bench_markdown(report))
    rows = report["results"]
    grouped_bars(rows, "tokens_per_s", "tokens/s", out / "throughput.png")
    grouped_bars(rows, "tau", "tau (mean acceptance length)", out / "tau.png")
    acceptance_plot(rows, out / "acceptance.png")
    time_split_plot(rows, out / "time_split.png")
    return [out / n for n in ("bench.json", "bench.md", "throughput.png", "tau.png", "acceptance.png",
                              "time_split.png")]  # fmt: skip


def sweep_markdown(sweep: dict) -> str:
    keys = sweep["keys"]
    keys = [k for k in keys if k not in ("config", "drafter")]  # the tree sweep's method name says both
    headers = ["method", *keys, "tok/s", "decode tok/s", "speedup", "tau", "ms/token p50"]
    body = [[p["method"], *(str(p[k]) for k in keys), fmt(p["tokens_per_s"], 1), fmt(p["decode_tokens_per_s"], 1),
             fmt(p.get("speedup"), 2, "x"), fmt(p["tau"]), fmt(p["per_token_latency_ms"]["p50"], 1)]
            for p in sweep["points"]]  # fmt: skip
    if sweep["sweep"] == "context":  # prefill grows fastest with the length: decode-only speedup, memory, retrieval
        headers += ["decode speedup", "prefill s", "peak RSS MB", "needle found"]
        for row, p in zip(body, sweep["points"]):
            row += [fmt(p.get("decode_speedup"), 2, "x"), fmt(p.get("prefill_s"), 1), fmt(p.get("peak_rss_mb"), 0),
                    fmt(p.get("needle_found"), 2)]  # fmt: skip
    lines = [f"# eaglespec bench --sweep {sweep['sweep']}", ""]
    if sweep.get("command"):
        lines += ["```bash", sweep["command"], "```", ""]
    lines += [table(headers, body, align_left=1)]
    if sweep.get("best"):
        best = [f"{k}: {v['config']} ({v['tokens_per_s']:.1f} tok/s, tau {v['tau']:.2f})"
                for k, v in sweep["best"].items()]  # fmt: skip
        lines += ["", "Best per drafter (tokens/s): " + "; ".join(best)]
    return "\n".join(lines) + "\n"


def sweep_plot(sweep: dict, path: Path) -> None:
    plt = _plt()
    points = sweep["points"]
    if sweep["sweep"] == "tree":  # one bar per shape
        fig, ax = plt.subplots(figsize=(6, max(3, 0.25 * len(points))))
        ax.barh([p["method"] for p in points], [p["tokens_per_s"] for p in points])
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s")
        ax.tick_params(axis="y", labelsize=6)
    else:  # tokens/s vs the swept value, one line per method
        x_key = sweep["keys"][0]
        fig, ax = plt.subplots(figsize=(6, 4))
        series: dict[str, list] = {}
        for p in points:
            label = p["method"] + (f" ({p['prompt']})" if "prompt" in p else "")
            series.setdefault(label, []).append((p[x_key], p["tokens_per_s"]))
        for label, pts in series.items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel(x_key)
        ax.set_ylabel("tokens/s")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep(sweep: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = f"sweep_{sweep['sweep']}"
    write_json(sweep, out / f"{name}.json")
    (out / f"{name}.md").write_text(sweep_markdown(sweep))
    sweep_plot(sweep, out / f"{name}.png")
    return [out / f"{name}.{ext}" for ext in ("json", "md", "png")]
