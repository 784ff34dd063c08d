"""Calibrated step costs: seconds for a target forward over n tokens per row and for one drafter
forward over k tokens per row, measured on this machine for this model pair, precision and batch size.

The speculation policy (speculation/policy.py) turns these into expected tokens per second. Measuring takes
a few seconds, so results are cached (machine.read_cached: calibration.json in machine.cache_dir()),
keyed by everything that changes them: CPU model, thread count, torch version, device, precision, batch
size and the models' shapes (not their weights: cost does not depend on the values). A corrupt or
unreadable cache file is ignored with a warning and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..machine import best_seconds, cache_file, cpu_name, read_cached, write_cached
from ..models.compiled import is_compiled
from ..models.fast_linear import kernel_signature

VERIFY_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRAFT_WIDTHS = (1, 2, 4, 8)
MAX_CALIBRATION_TOKENS = 2048  # per forward (batch x tokens): larger trees are not considered
CALIBRATION_CONTEXT = 256  # committed cache length the forwards attend over
LONG_CONTEXT = 4096  # a second, shorter table here: attention makes verification dearer with context
LONG_GRID = (1, 4, 16)  # per-row tokens measured at LONG_CONTEXT (n * batch <= LONG_MAX_TOKENS)
LONG_MAX_TOKENS = 512
LONG_CACHE_POSITIONS = 65536  # batch x context of the long measurement's cache (memory)
CONTEXT_STEP = 128  # the context a cost is asked for is rounded to this (the policy's table is cached)
FORMAT = 2
CACHE = "calibration.json"  # in machine.cache_dir()


@dataclass
class StepCosts:
    """Seconds per forward at one batch size: verify[n] = target forward over n tokens per row
    (lm_head included); draft[k] = drafter forward over k tokens per row (lm_head, log-softmax and
    top-k included)."""

    batch: int
    verify: dict[int, float]
    draft: dict[int, float]
    long: dict[int, float] | None = None  # verify[n] at long_context committed positions (None: not measured)
    long_context: int = LONG_CONTEXT
    context: int = CALIBRATION_CONTEXT  # the rows' current mean length (set_context); verify_cost is for it

    def set_context(self, context: int) -> None:
        """Costs for rows of about `context` committed tokens from now on (the core sets it every step)."""
        context = max(1, round(context / CONTEXT_STEP)) * CONTEXT_STEP
        if context != self.context:
            self.context = context
            self.__dict__.pop("_table", None)

    def verify_cost(self, n: int) -> float:
        """A target forward over n tokens per row at self.context: the table at CALIBRATION_CONTEXT plus,
        per extra committed position, the slope measured up to long_context (attention is linear in the
        context and in the queries: beyond the long grid the slope grows with n)."""
        base = _interpolate(self.verify, n)
        if not self.long or self.context == CALIBRATION_CONTEXT or base == float("inf"):
            return base
        top = max(self.long)
        extra = (self.long[top] - _interpolate(self.verify, top)) * n / top if n > top else \
            _interpolate(self.long, n) - base  # what the long context added, measured or scaled in n  # fmt: skip
        slope = max(0.0, extra) / (self.long_context - CALIBRATION_CONTEXT)
        return max(0.5 * base, base + slope * (self.context - CALIBRATION_CONTEXT))

    def verify_costs(self, up_to: int) -> list[float]:
        """[verify_cost(1), ..., verify_cost(up_to)], computed once per StepCosts and context (the policy
        asks for it several times per step)."""
        table = self.__dict__.setdefault("_table", [])
        while len(table) < up_to:
            table.append(self.verify_cost(len(table) + 1))
        return table[:up_to]

    def draft_cost(self, k: int) -> float:
        return _interpolate(self.draft, k)

    def scaled(self, factor: float) -> StepCosts:
        """Every cost times factor (a machine measured to run that much slower or faster than calibrated)."""
        def times(table):
            return {n: s * factor for n, s in table.items()}

        return StepCosts(self.batch, times(self.verify), times(self.draft), self.long and times(self.long),
                         self.long_context, self.context)  # fmt: skip

    @property
    def max_verify_tokens(self) -> int:
        return max(self.verify)

    def to_json(self) -> dict:
        return {"batch": self.batch, "verify": self.verify, "draft": self.draft, "long": self.long,
                "long_context": self.long_context}  # fmt: skip

    @classmethod
    def from_json(cls, raw: dict) -> StepCosts:
        verify = {int(k): float(v) for k, v in raw["verify"].items()}
        draft = {int(k): float(v) for k, v in raw["draft"].items()}
        long = {int(k): float(v) for k, v in raw["long"].items()} if raw.get("long") else None
        if not verify or not draft or min(verify.values()) <= 0 or min(draft.values()) <= 0 or 1 not in verify:
            raise ValueError("calibration entry has empty or non-positive costs")
        if long is not None and (min(long.values()) <= 0 or not set(long) <= set(verify)):
            raise ValueError("calibration entry has a bad long-context table")
        return cls(int(raw["batch"]), verify, draft, long, int(raw.get("long_context", LONG_CONTEXT)))


def _interpolate(table: dict[int, float], x: int) -> float:
    """Piecewise-linear in x; beyond the largest measured point the cost is infinite (never chosen)."""
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    if x > keys[-1]:
        return float("inf")
    for a, b in zip(keys, keys[1:]):
        if a <= x <= b:
            w = (x - a) / (b - a)
            return table[a] * (1 - w) + table[b] * w
    return table[keys[-1]]


def tightened(by_batch: dict[int, StepCosts]) -> dict[int, StepCosts]:
    """The costs of several batch buckets, each made the least measured cost at or above it: a forward
    over more tokens per row, or over more rows, never costs less, and timing noise only ever adds time.
    So one slow measurement (a busy moment, seen at 2x on 2 shared cores: a 16-row plain step measured
    at 251 ms beside 225 ms for 2 tokens a row and 128 ms for 32 rows) cannot make plain steps look
    dear and speculation look cheap. Long-context tables are tightened within themselves only (each
    bucket measures them at its own context)."""
    out = {b: StepCosts(c.batch, _least_above(c.verify), _least_above(c.draft), c.long and _least_above(c.long),
                        c.long_context, c.context) for b, c in by_batch.items()}  # fmt: skip
    larger = None
    for b in sorted(out, reverse=True):
        if larger is not None:
            for table, bound in ((out[b].verify, larger.verify), (out[b].draft, larger.draft)):
                for n in table.keys() & bound.keys():
                    table[n] = min(table[n], bound[n])
            out[b].verify, out[b].draft = _least_above(out[b].verify), _least_above(out[b].draft)
        larger = out[b]
    return out


def _least_above(table: dict[int, float]) -> dict[int, float]:
    """table[n] -> min over m >= n of table[m] (non-decreasing in n)."""
    out, least = {}, math.inf
    for n in sorted(table, reverse=True):
        least = min(least, table[n])
        out[n] = least
    return dict(sorted(out.items()))


# -- cache ---------------------------------------------------------------------------------------
def _model_signature(model) -> dict:
    params = [(n, list(p.shape), str(p.dtype)) for n, p in [*model.named_parameters(), *model.named_buffers()]
              if not n.startswith("_target_embed")]  # the drafter's view of the target's embedding
    cfg = getattr(model, "cfg", None)
    return {"cfg": repr(cfg), "params": hashlib.sha1(repr(params).encode()).hexdigest()}


def cache_key(target, drafter, batch: int) -> str:
    p = next(target.parameters())
    parts = {
        "format": FORMAT,
        "cpu": cpu_name() if p.device.type == "cpu" else torch.cuda.get_device_name(p.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(p.device),
        "dtype": str(p.dtype),
        "compiled": is_compiled(target),
        "kernels": [kernel_signature(m) for m in (target, drafter) if m is not None],
        "batch": batch,
        "quantization": getattr(target, "quantization", None),  # int8 and w8a8 hold the same tensors
        "runtime": target.describe() if hasattr(target, "describe") else "torch",  # llama.cpp: file, KV, rows
        "draft_runtime": drafter.describe() if hasattr(drafter, "describe") else "torch",
        "target": _model_signature(target),
        "drafter": _model_signature(drafter) if drafter is not None else None,
    }
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load_or_calibrate(target, drafter, batch: int, *, path: Path | None = None) -> StepCosts:
    """Cached costs for this machine/model/precision/batch, measured when missing (a few seconds; about a
    minute through llama.cpp). `path`: another cache file than machine.cache_dir()'s CACHE."""
    name = path or CACHE
    key = cache_key(target, drafter, batch)
    entry = read_cached(name, what="calibration").get(key)
    if entry is not None:
        try:
            return StepCosts.from_json(entry)
        except (KeyError, TypeError, ValueError) as e:
            warnings.warn(f"ignoring a corrupt calibration entry in {cache_file(name)} ({e}); recalibrating",
                          stacklevel=2)  # fmt: skip
    costs = calibrate(target, drafter, batch)
    error = write_cached(name, key, costs.to_json())
    if error is not None:  # a read-only home still works, just without the cache
        warnings.warn(f"could not write calibration cache {cache_file(name)}: {error}", stacklevel=2)
    return costs


# -- measuring -----------------------------------------------------------------------------------
@torch.inference_mode()
def calibrate(target, drafter, batch: int, *, context: int = CALIBRATION_CONTEXT, repeats: int = 5) -> StepCosts:
    """Measure target forwards over n tokens per row (n in VERIFY_GRID) and drafter forwards over k
    tokens per row (k in DRAFT_WIDTHS) attending over `context` committed positions, and target
    forwards over a few n at a long context (`long_context_grid`)."""
    dev = next(target.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = None
    gen = torch.Generator(device="cpu").manual_seed(0)
    grid = [n for n in VERIFY_GRID if n * batch <= MAX_CALIBRATION_TOKENS] or [1]
    verify = _target_costs(target, drafter is not None, batch, context, grid, gen, sync,
                           lambda n: repeats if n * batch <= 256 else max(2, repeats // 2))  # fmt: skip
    long_context, long_grid = long_context_grid(target, batch, grid)
    long = _target_costs(target, drafter is not None, batch, long_context, long_grid, gen, sync, lambda n: 3) \
        if long_grid else None  # fmt: skip
    draft = {}
    if drafter is not None:
        if drafter.embed_tokens is None and drafter._target_embed is None:
            drafter.attach_target_embedding(target.model.embed_tokens)
        dcache = drafter.new_cache(batch, max_length=context + max(DRAFT_WIDTHS) + 1)
        dcache.commit(rows, torch.full((batch,), context))
        for k in DRAFT_WIDTHS:
            ids = torch.randint(0, target.cfg.vocab_size, (batch, k), generator=gen).to(dev)
            hidden = torch.zeros(batch, k, drafter.cfg.hidden_size, device=dev, dtype=drafter.fc.weight.dtype)
            mask = torch.eye(k, dtype=torch.bool, device=dev).expand(batch, k, k)  # k nodes of one tree level
            pos = torch.full((batch, k), context, device=dev)

            def run_drafter(ids=ids, hidden=hidden, mask=mask, pos=pos, k=k):
                meta = dcache.prepare(rows, mask, pos)
                logits, _ = drafter(ids, hidden, pos, dcache, meta)
                logits.float().log_softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
                sync()

            draft[k] = best_seconds(run_drafter, repeats)
    else:
        draft = {1: float("inf")}
    return StepCosts(batch, verify, draft, long, long_context)


def long_context_grid(target, batch: int, grid: list[int]) -> tuple[int, list[int]]:
    """(context, token counts) of the long-context measurement: LONG_CONTEXT, less where the model's
    context or the cache's size (LONG_CACHE_POSITIONS over all rows) is smaller; no counts when that
    leaves under twice CALIBRATION_CONTEXT."""
    context = min(LONG_CONTEXT, target.cfg.max_position_embeddings - max(LONG_GRID) - 1,
                  LONG_CACHE_POSITIONS // batch)  # fmt: skip
    counts = [n for n in LONG_GRID if n in grid and n * batch <= LONG_MAX_TOKENS]
    return (context, counts) if context >= 2 * CALIBRATION_CONTEXT else (LONG_CONTEXT, [])


def _target_costs(target, capture_aux: bool, batch: int, context: int, grid, gen, sync, repeats) -> dict[int, float]:
    """Seconds of a target forward over n tokens per row (lm_head and argmax included) for n in grid,
    attending over `context` committed positions; repeats(n) timings, the best kept."""
    from ..kv_cache import causal_mask

    dev = next(target.parameters()).device
    cache = target.new_cache(batch, max_length=context + max(grid) + 1, initial_capacity=context + max(grid) + 1)
    cache.commit(None, torch.full((batch,), context))
    costs = {}
    for n in grid:
        ids = torch.randint(0, target.cfg.vocab_size, (batch, n), generator=gen).to(dev)
        mask = causal_mask(torch.full((batch,), n, device=dev), n)
        pos = torch.full((batch, 1), context, device=dev) + torch.arange(n, device=dev)

        def run(ids=ids, mask=mask, pos=pos):
            meta = cache.prepare(None, mask, pos)
            h, _ = target(ids, pos, cache, meta, capture_aux=capture_aux)
            target.logits(h).argmax(-1)
            sync()

        costs[n] = best_seconds(run, repeats(n))
    return costs
