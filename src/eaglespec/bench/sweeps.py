"""Sweeps over batch size, context length and draft shape, and `--auto` (quick shape sweep -> tuned.json).

Each point runs one method on the sweep's prompts (same prompts for every method at a point) and
reports the bench metrics plus the swept values. Speedups are relative to `plain` at the same point.
The shape sweep forces speculation (adaptive governor off) so each shape is measured for what it is;
`generate` still runs the governor on top of the chosen shape.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ..speculation.config import TreeShape
from ..suites import Prompt
from .engine_methods import Models, plain_method, shape_settings, spec_method
from .method import Method
from .metrics import add_speedups, summarize
from .runner import RunConfig, measure, warm_up

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (512, 2048, 4096, 8192, 16384, 32768)
FULL_GRID = {"depth": (2, 3, 4, 6), "topk": (2, 4, 8), "tokens": (8, 16, 32, 64), "chain": (1, 2, 3, 4, 5, 6)}
QUICK_GRID = {"depth": (3, 4, 6), "topk": (2, 4), "tokens": (8, 16), "chain": (2, 3, 4)}


def parse_values(text: str | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--sweep-values for {what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--sweep-values for {what}: need integers >= 1, got {text!r}")
    return values


def parse_grid(text: str | None, default: dict) -> dict:
    """'depth=2,4;topk=2,4;tokens=8,16;chain=2,4' (keys left out keep the default; chain= empty: no chains)."""
    if text is None:
        return dict(default)
    grid = dict(default)
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, vals = part.partition("=")
        key = key.strip()
        if key not in FULL_GRID:
            raise ValueError(f"--grid: unknown key {key!r}; use depth, topk, tokens, chain")
        grid[key] = parse_values(vals, (), f"--grid {key}") if vals.strip() else ()
    return grid


def shapes(grid: dict) -> list[tuple[str, TreeShape]]:
    """Chains, then trees; trees whose token budget exceeds what the shape can produce are dropped."""
    out = [("chain", TreeShape.chain(k)) for k in grid.get("chain", ())]
    seen = set()
    for d, k, n in itertools.product(grid["depth"], grid["topk"], grid["tokens"]):
        shape = TreeShape(d, k, n)
        if n <= shape.max_candidates and (d, k, shape.kept_nodes) not in seen:
            seen.add((d, k, shape.kept_nodes))
            out.append(("tree", shape))
    return out


def shape_label(kind: str, shape: TreeShape) -> str:
    return f"chain k={shape.depth}" if kind == "chain" else f"tree d{shape.depth}/k{shape.top_k}/{shape.num_nodes}"


def point(method: Method, prompts: list[Prompt], cfg: RunConfig, group: str, **keys) -> dict:
    return point_row(method, measure(method, prompts, cfg), group, **keys)


def point_row(method: Method, m, group: str, **keys) -> dict:
    row = summarize(method, group, m)
    s = m.stats
    decode = m.wall_s - s.time_prefill if s is not None else None
    row["decode_tokens_per_s"] = m.new_tokens / decode if decode else None
    row.update(keys)
    return row


def _log_point(log, row: dict, keys: list[str]) -> None:
    where = " ".join(f"{k}={row[k]}" for k in keys)
    log(f"[sweep] {where:<28} {row['method']:<24} {row['tokens_per_s']:8.1f} tok/s tau {row['tau'] or 0:.2f}")


def sweep_batch(methods: list[Method], pool: list[Prompt], cfg: RunConfig, sizes, log: Callable = print) -> dict:
    """Throughput vs batch size; each point decodes max(B, len(pool)) prompts (the pool repeated)."""
    for m in methods:
        warm_up(m, pool[0], cfg)
        m.prepare(max(sizes))
    points = []
    for i, b in enumerate(sizes):
        prompts = list(itertools.islice(itertools.cycle(pool), max(b, len(pool))))
        run = RunConfig(cfg.max_new_tokens, b, cfg.params, False)
        # the methods in alternating order: at 64 rows `auto` with speculation off measured 1.18x plain when it
        # always ran second (suspected: the first run of a size first-touches its memory), so order must not favour one
        for m in methods if i % 2 == 0 else methods[::-1]:
            points.append(point(m, prompts, run, f"batch={b}", batch_size=b))
            _log_point(log, points[-1], ["batch_size"])
    add_speedups(points)
    return {"sweep": "batch", "keys": ["batch_size"], "points": points}


def sweep_context(methods: list[Method], by_length: dict[int, list[Prompt]], cfg: RunConfig,
                  log: Callable = print, decode: Callable | None = None) -> dict:  # fmt: skip
    """Per length: each method on the continuation prompts and, separately, on the needle prompts.
    Besides the bench metrics, each point has its prefill time, its decode-only speedup (prefill is the
    same work for every method and grows fastest with the length) and, for needles, the share found."""
    if not by_length:
        raise ValueError("no context prompt fits the requested lengths and the target's context")
    first = next(iter(by_length.values()))[0]
    for m in methods:
        warm_up(m, first, cfg)
    points = []
    for n, prompts in by_length.items():
        for kind in ("text", "needle"):
            group = [p for p in prompts if p.category == kind]
            if not group:
                continue
            for m in methods:
                measured = measure(m, group, cfg)
                row = point_row(m, measured, f"context={n} {kind}", context=n, prompt=kind)
                row["prefill_s"] = (row["time_split_s"] or {}).get("prefill")
                if kind == "needle" and decode is not None:
                    found = [p.answer in decode(o) for p, o in zip(group, measured.outputs)]
                    row["needle_found"] = sum(found) / len(group)
                points.append(row)
                _log_point(log, row, ["context", "prompt"])
    add_speedups(points)
    base = {p["category"]: p["decode_tokens_per_s"] for p in points if p["method"] == "plain"}
    for p in points:
        b = base.get(p["category"])
        p["decode_speedup"] = p["decode_tokens_per_s"] / b if b and p["decode_tokens_per_s"] else None
    return {"sweep": "context", "keys": ["context", "prompt"], "points": points}


def sweep_tree(models: Models, prompts: list[Prompt], cfg: RunConfig, grid: dict, log: Callable = print) -> dict:
    """Every shape of the grid per drafter (speculation forced), plus plain; best shape per drafter by tokens/s."""
    if not models.drafters:
        raise ValueError("the tree sweep and --auto need a drafter: pass --draft DIR")
    todo = shapes(grid)
    if not todo:
        raise ValueError("--grid leaves no chain or tree shape to measure")
    plain = plain_method(models)
    warm_up(plain, prompts[0], cfg)
    points = [point(plain, prompts, cfg, "shape", drafter="-", config="plain")]
    _log_point(log, points[-1], ["config"])
    for label, path, drafter in models.drafters:
        for kind, shape in todo:
            m = spec_method(models, label, path, drafter, kind, tree=shape, chain_k=shape.depth, adaptive=False,
                            name=f"{label} {shape_label(kind, shape)}")  # fmt: skip
            warm_up(m, prompts[0], cfg)
            row = point(m, prompts, cfg, "shape", drafter=label, config=shape_label(kind, shape))
            row["settings"] = shape_settings(kind, m.engine.shape)
            row["drafter_path"] = str(path)
            points.append(row)
            _log_point(log, row, ["config"])
    add_speedups(points)
    best = {}
    for label, _, _ in models.drafters:
        mine = [p for p in points if p["drafter"] == label]
        top = max(mine, key=lambda p: p["tokens_per_s"])
        best[label] = {"config": top["config"], "settings": top["settings"], "drafter_path": top["drafter_path"],
                       "tokens_per_s": top["tokens_per_s"], "tau": top["tau"], "speedup": top["speedup"]}  # fmt: skip
    return {"sweep": "tree", "keys": ["config", "drafter"], "points": points, "best": best}
