"""Run every method on the same prompts, summarize, and check that lossless methods agree.

Lossless check (greedy only): every lossless method's output must equal the reference method's
(`plain` when it runs, else the first lossless method) token for token. Outputs are compared over
their common length: a method that stops earlier or later (an EOS handled differently by a peer, a
context limit) is listed under `length_differences` but is not a mismatch by itself; a differing
token inside the common length is. With temperature > 0 outputs are random, so the check is skipped
(`applicable: false`); distribution-level losslessness is tested in tests/test_sampling_lossless.py.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import machine
from ..sampling import SamplingParams
from ..suites import Prompt
from .method import Method
from .metrics import Measurement, PeakRSS, add_speedups, combine, summarize


@dataclass
class RunConfig:
    max_new_tokens: int = 64
    batch_size: int = 1
    params: SamplingParams = SamplingParams()
    warmup: bool = True


def measure(method: Method, prompts: list[Prompt], cfg: RunConfig) -> Measurement:
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        run = method.run([p.ids for p in prompts], cfg.max_new_tokens, cfg.params, cfg.batch_size)
        wall = time.perf_counter() - t0
    return Measurement(run.outputs, run.latencies, run.target_forwards, wall, run.stats, mem.peak_mb,
                       mem.before_mb, mem.source, [p.id for p in prompts])  # fmt: skip


def warm_up(method: Method, prompt: Prompt, cfg: RunConfig) -> None:
    method.run([prompt.ids[-256:]], min(8, cfg.max_new_tokens), cfg.params, 1)


def run_bench(methods: list[Method], prompts: dict[str, list[Prompt]], cfg: RunConfig,
              log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Measure each method on each category (categories outer, so slow drifts hit all methods alike)."""
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    first = next(iter(prompts.values()))[0]
    if cfg.warmup:
        for m in methods:
            warm_up(m, first, cfg)
    measured: dict[tuple[str, str], Measurement] = {}
    for cat, items in prompts.items():
        for m in methods:
            measured[m.name, cat] = x = measure(m, items, cfg)
            log(f"[bench] {cat:<18} {m.name:<22} {x.new_tokens:5d} tokens {x.wall_s:7.2f}s "
                f"{x.new_tokens / max(x.wall_s, 1e-9):8.1f} tok/s")  # fmt: skip
    rows = [summarize(m, cat, measured[m.name, cat]) for cat in prompts for m in methods]
    rows += [summarize(m, "all", combine([measured[m.name, c] for c in prompts])) for m in methods]
    add_speedups(rows)
    outputs = {m.name: {cat: measured[m.name, cat].outputs for cat in prompts} for m in methods}
    ids = {cat: [p.id for p in items] for cat, items in prompts.items()}
    check = lossless_check(methods, outputs, ids, cfg.params)
    return {
        "config": {"max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size,
                   "temperature": cfg.params.temperature, "top_p": cfg.params.top_p, "top_k": cfg.params.top_k,
                   "seed": cfg.params.seed, "categories": list(prompts),
                   "prompts_per_category": {c: len(v) for c, v in prompts.items()},
                   "peer_batch_size": 1},  # fmt: skip
        "environment": environment(),
        "methods": [{"name": m.name, "kind": m.kind, "lossless": m.lossless, "settings": m.settings} for m in methods],
        "results": rows,
        "lossless_check": check,
        "outputs": {name: {cat: [{"id": i, "output_ids": o} for i, o in zip(ids[cat], outs)]
                           for cat, outs in per_cat.items()} for name, per_cat in outputs.items()},  # fmt: skip
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index < min(len) where a and b differ, else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def lossless_check(methods: list[Method], outputs: dict, prompt_ids: dict[str, list[str]],
                   params: SamplingParams) -> dict:  # fmt: skip
    lossless = [m.name for m in methods if m.lossless]
    if not params.greedy or len(lossless) < 2:
        why = "temperature > 0: outputs are samples" if not params.greedy else "fewer than two lossless methods"
        return {"applicable": False, "reason": why, "passed": None, "mismatches": [], "length_differences": []}
    ref = "plain" if "plain" in lossless else lossless[0]
    mismatches, lengths, compared = [], [], 0
    for name in lossless:
        if name == ref:
            continue
        for cat, ref_outs in outputs[ref].items():
            for i, (want, got) in enumerate(zip(ref_outs, outputs[name][cat])):
                compared += 1
                pos = first_difference(want, got)
                where = {"method": name, "reference": ref, "category": cat, "prompt_id": prompt_ids[cat][i]}
                if pos is not None:
                    mismatches.append({**where, "position": pos, "expected": want[pos], "got": got[pos]})
                elif len(want) != len(got):
                    lengths.append({**where, "reference_len": len(want), "len": len(got)})
    return {"applicable": True, "reference": ref, "methods": lossless, "compared": compared,
            "passed": not mismatches, "mismatches": mismatches, "length_differences": lengths}  # fmt: skip


def describe_mismatches(check: dict, limit: int = 20) -> list[str]:
    return [
        f"LOSSLESS MISMATCH: {x['method']} vs {x['reference']} on {x['category']} prompt {x['prompt_id']}: "
        f"first differing position {x['position']} (expected token {x['expected']}, got {x['got']})"
        for x in check["mismatches"][:limit]
    ]


def cpu_name() -> str:
    return f"{machine.cpu_name()} ({os.cpu_count()} logical CPUs)"


def environment() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "cpu": cpu_name(), "python": platform.python_version()}  # fmt: skip
