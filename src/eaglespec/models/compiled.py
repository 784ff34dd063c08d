"""Compiled forwards: `torch.compile` (inductor) for the target's and the drafter's forward, eager fallback.

Why: on CPU a step of a small model is mostly per-op overhead (dozens of tiny element-wise kernels and
oneDNN calls); inductor fuses the norms, RoPE, residual adds and SwiGLU into a few C++ kernels and calls
MKL for the matmuls. Measured on a 2-vCPU Xeon (AMX) with the bundled target, fp32: a one-token step
1.4 ms compiled vs 1.9 ms eager F.linear and 2.9 ms eager oneDNN-packed (BENCHMARKS.md, Speed at batch 1).

Graphs: dynamo specialises on a step's structure (one token without a mask or several with one; aux
capture on or off; slice or scatter cache writes; the drafter's extend or tree level), so each model
ends with a handful of graphs whose sizes (tokens per row, cache span, batch) stay dynamic. Compiling
them costs seconds each (tens of seconds in all on 2 cores; inductor's on-disk cache roughly halves it
for the next process), which is why `--compile auto` compiles only where a measurement on this machine
said compiled steps are faster, and, for a finite job, only when the time saved pays for compiling
(`decide`). The measurement is cached on disk next to the calibration (speculation/costs.py).

Losslessness: plain steps and verification forwards of a compiled model both run the compiled graphs;
`api.load_target_for_speculation` checks, as for any precision, that a token's logits in a verification
forward match its plain step's (else the model stays eager).
"""

from __future__ import annotations

import time
import types
import warnings

import torch

from ..machine import read_cached, write_cached

CHOICES = ("auto", "on", "off")
RECOMPILE_LIMIT = 64  # graphs per forward (dynamo's default of 8 is too few for prefill/plain/tree x batch)
MIN_GAIN = 0.95  # compiled must take at most this share of the eager step time to be chosen


def is_compiled(model) -> bool:
    return model.__dict__.get("_eager_forward") is not None


def compile_model(model):
    """Route `model(...)` through torch.compile(model.forward); idempotent. Graphs are built on first use."""
    if is_compiled(model):
        return model
    import torch._dynamo.config as dynamo_config

    from .fast_linear import prepare_for_inference

    prepare_for_inference(model, traceable=True)  # W8A8 layers get kernels the graphs can trace

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 8 * RECOMPILE_LIMIT)
    eager = model.forward
    fast = torch.compile(types.MethodType(_own_copy(eager.__func__), model), dynamic=True)

    def forward(*args, **kwargs):  # dense inputs: strides of sliced/expanded views would each get a graph
        return fast(*(_dense(a) if isinstance(a, torch.Tensor) else a for a in args), **kwargs)

    model.__dict__["_eager_forward"] = eager
    model.__dict__["forward"] = forward
    return model


def _own_copy(fn):
    """fn with a code object of its own: dynamo keeps graphs and guards per code object, so models of one
    class would share them, and checking one model's guards on another of a different make-up (an
    unquantized model's graphs on a quantized one's fused layers) raised AttributeError inside dynamo."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x with row-major strides (also for size-1 dims, whose strides `contiguous()` leaves alone)."""
    want, step = [], 1
    for size in reversed(x.shape):
        want.append(step)
        step *= size
    return x if tuple(reversed(want)) == x.stride() else x.clone(memory_format=torch.contiguous_format)


def uncompile(model):
    """Back to the eager forward (after a compile failure, or when compiling does not pay)."""
    if is_compiled(model):
        model.__dict__["forward"] = model.__dict__.pop("_eager_forward")
        model.__dict__.pop("forward", None)  # the class method again
    return model


def try_compiled(models, run, what: str = "warm-up") -> str | None:
    """Call run() with `models` compiled; on any exception put them back to eager and return the reason
    (also warned), else None. Compiling happens here, not inside a timed or user-facing step."""
    for m in models:
        compile_model(m)
    try:
        run()
        return None
    except Exception as e:  # dynamo/inductor raise many kinds; eager always works
        for m in models:
            uncompile(m)
        reason = f"torch.compile failed during {what} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); using eager"
        warnings.warn(reason, stacklevel=2)
        return reason


# -- measured choice -------------------------------------------------------------------------------
CACHE = "compile.json"


def read_verdicts() -> dict:
    return read_cached(CACHE)


def write_verdict(key: str, verdict: dict) -> None:
    write_cached(CACHE, key, verdict)


def valid_verdict(v) -> bool:
    return (isinstance(v, dict) and all(isinstance(v.get(k), (int, float)) and v[k] > 0
                                        for k in ("eager_step_s", "compiled_step_s", "compile_s")))  # fmt: skip


def decide(verdict: dict, expected_tokens: int | None) -> tuple[bool, str]:
    """(compile?, reason) from a measurement: compiled steps must be clearly faster and, for a job of
    `expected_tokens` target steps at most (None: a long-lived server), save more than compiling costs."""
    eager, comp, cost = verdict["eager_step_s"], verdict["compiled_step_s"], verdict["compile_s"]
    measured = f"one-token step {eager * 1e3:.2f} ms eager vs {comp * 1e3:.2f} ms compiled, compiling ~{cost:.0f} s"
    if comp > MIN_GAIN * eager:
        return False, f"eager ({measured}: not faster here)"
    if expected_tokens is not None and expected_tokens * (eager - comp) < cost:
        return False, f"eager ({measured}: {expected_tokens} tokens would not pay for compiling)"
    return True, f"compiled ({measured})"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
