"""Precision rules: the precision `--dtype auto` picks, whether a target attends row-invariantly (and in what
precision a quantized one attends where it cannot), and the gap a target may have between a verification
forward and a plain step.

`--dtype auto` (`choose_dtype`): the precision this device runs the model fastest in.
`row_invariant_attention`: fp32 targets on CPU attend with models/row_attention (exact by construction);
`attention_dtype`: where that kernel cannot run, fp64 attention for a quantized target on CPU.
`max_tree_plain_gap`: the gap allowed, as `tree_plain_gap` measures it. `exactness_note`: what the
precision's reason says about exactness.

Target and drafter always share the chosen precision, so plain and speculative decoding compute
their logits with the same kernels' precision and greedy outputs stay identical at that precision.

CPU: bf16 only where the CPU computes it natively (AMX or AVX-512 BF16; without them bf16 is emulated
and measured ~20x slower than fp32 on AVX2-only EPYCs) *and* a quick measurement (the packed kernels of
models/fast_linear.py) on the model's own matrix shapes (one token, as in plain decoding, and 17 tokens,
as in verifying a tree) says it is faster; fp32 otherwise. CUDA: bf16 where supported, else fp16.
The measurement (well under a second) is cached per machine (machine.read_cached/write_cached).
"""

from __future__ import annotations

import torch

from .. import machine
from ..machine import best_seconds, cpu_name

CHOICES = ("auto", "fp32", "bf16", "fp16")
_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def _time_linear(w: torch.Tensor, m: int, repeats: int = 30) -> float:
    """Seconds per call of the kernel inference really uses (oneDNN-packed where available)."""
    from .fast_linear import FastLinear

    x, layer = torch.randn(m, w.shape[1], dtype=w.dtype), FastLinear(w, None)
    return best_seconds(lambda: layer(x), repeats, warmup=3)


def measure_cpu(hidden: int, intermediate: int, vocab: int) -> dict:
    """Seconds per linear in fp32 and bf16 for this model's shapes at 1 and 17 tokens."""
    g = torch.Generator().manual_seed(0)
    shapes = [(intermediate, hidden), (hidden, intermediate), (min(vocab, 32768), hidden)]
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ws = [torch.randn(o, i, generator=g).to(dt) for o, i in shapes]
        out[name] = {str(m): sum(_time_linear(w, m) for w in ws) for m in (1, 17)}
    return out


CACHE = "precision.json"  # in machine.cache_dir()


def choose_dtype(device: str, requested: str, *, hidden: int, intermediate: int, vocab: int) -> tuple[str, str]:
    """Returns (dtype name, reason). Raises ValueError for an unknown or unsupported request."""
    if requested not in CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(CHOICES)}, got {requested!r}")
    dev = torch.device(device)
    if requested != "auto":
        if dev.type == "cpu" and requested == "fp16":
            raise ValueError("--dtype fp16 is not supported on CPU (no fast fp16 kernels); use auto, fp32 or bf16")
        if dev.type == "cuda" and requested == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError("this GPU has no bf16 support; use --dtype fp16 or auto")
        return requested, "requested"
    if dev.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "CUDA with bf16 support"
        return "fp16", "CUDA without bf16 support"
    if dev.type != "cpu":
        return "fp32", f"device {dev.type}: fp32 (no measurement for this device)"
    flags = machine.cpu_flags()
    native = [f for f in _NATIVE_BF16_FLAGS if f in flags]
    if not native:
        return "fp32", "CPU has no native bf16 (no AMX or AVX-512 BF16): fp32"
    key = f"{cpu_name()}|{torch.get_num_threads()}|{torch.__version__}|{hidden}x{intermediate}x{vocab}"
    t = machine.read_cached(CACHE).get(key)
    if t is None:
        t = measure_cpu(hidden, intermediate, vocab)
        machine.write_cached(CACHE, key, t)
    f32, f32_17, b16, b16_17 = t["fp32"]["1"], t["fp32"]["17"], t["bf16"]["1"], t["bf16"]["17"]
    # a plain step is one token, a speculative step verifies ~17: weigh both equally
    choice = "bf16" if b16 + b16_17 < 0.9 * (f32 + f32_17) else "fp32"
    detail = (f"{'+'.join(native)}; measured on the model's shapes, 1 / 17 tokens: fp32 {f32 * 1e3:.2f} / "
              f"{f32_17 * 1e3:.2f} ms, bf16 {b16 * 1e3:.2f} / {b16_17 * 1e3:.2f} ms")  # fmt: skip
    return choice, detail


# Largest |logit difference| between a token's plain step and its verification forward that `--dtype
# auto` accepts. fp32 on the bundled target measures ~4e-6 (summation order inside attention), which
# never flipped a greedy token in the suites; bf16 on AVX-512 BF16 measures 0.06 and flipped 3 of 24
# prompts (BENCHMARKS.md, Speed at batch 1), so auto falls back to fp32 there.
MAX_TREE_PLAIN_GAP = 1e-4


def max_tree_plain_gap(target) -> float:
    """The gap this target may have: none for a quantized one, whose layers round their inputs and so turn
    any difference into other tokens (models/quantized_linear.py); MAX_TREE_PLAIN_GAP otherwise."""
    return 0.0 if getattr(target, "quantization", None) is not None else MAX_TREE_PLAIN_GAP


def row_invariant_attention(param: torch.Tensor) -> bool:
    """Does a target with this parameter's precision and device attend with models/row_attention (each row's
    bits independent of the step's other rows)? fp32 on CPU, where its kernel compiled."""
    from . import row_attention

    return param.device.type == "cpu" and param.dtype == torch.float32 and row_attention.available()


def exactness_note(param: torch.Tensor) -> str:
    """What `--dtype` reasons add: whether a PyTorch target's verification rows have the bits of one-token
    steps by construction, and if not, why."""
    from . import row_attention

    if row_invariant_attention(param):
        return "; verification rows exact by construction (row-invariant attention and linears)"
    kind = f"{str(param.dtype).removeprefix('torch.')} on {param.device.type}"
    why = row_attention.unavailable_reason() if kind == "float32 on cpu" else None
    return f"; verification rows not exact by construction ({why or 'no row-invariant attention for ' + kind})"


def attention_dtype(model: torch.nn.Module, param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The precision a target attends in (and keeps its KV cache in) where the row-invariant kernel
    (models/row_attention.py, fp32, exact by construction) cannot run: fp64 for a quantized target on CPU.
    Why: its quantized layers round their inputs (to bf16, or to int8 steps for W8A8), so a last-bit
    difference in an attention output between a tree forward and a plain step (~1e-6 in fp32: the
    summation order changes with the row count) can cross a rounding step and change a token (measured:
    2 of 16 prompts on the bundled pair with W8A8). In fp64 the two agree to ~1e-15, far below the
    resolution of the result's precision, so they round to the same bits (tests/test_quantize.py)."""
    if getattr(model, "quantization", None) is not None and device.type == "cpu":
        return torch.float64
    return param_dtype


@torch.inference_mode()
def tree_plain_gap(target, *, prompt_len: int = 40, tree_len: int = 17, seed: int = 0) -> float:
    """Max |logit difference| for one token between a one-token plain step and the first position of a
    `tree_len`-token verification forward, with this target's loaded precision and kernels. Greedy
    speculation equals plain decoding only while this is far below the gaps between top logits;
    rounding that depends on the number of rows (GEMM or attention blocking) makes it large."""
    from ..kv_cache import causal_mask

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.cfg.vocab_size, (1, prompt_len + tree_len), generator=g)
    ids = ids.to(next(target.parameters()).device)
    cache = target.new_cache(1, max_length=prompt_len + tree_len + 1)
    meta = cache.prepare(None, causal_mask(torch.tensor([prompt_len]), prompt_len))
    target(ids[:, :prompt_len], meta.write_pos, cache, meta, capture_aux=False)
    cache.commit(None, torch.tensor([prompt_len]))
    logits = []
    for t in (1, tree_len):
        meta = cache.prepare(None, causal_mask(torch.tensor([t]), t))
        h, _ = target(ids[:, prompt_len : prompt_len + t], meta.write_pos, cache, meta, capture_aux=False)
        logits.append(target.logits(h[:, :1]).float())  # the first new token; nothing is committed
    return float((logits[0] - logits[1]).abs().max())


PROBE_CHUNK = 512  # prefill chunk of row_gap's context (the engine's prefill chunk)


@torch.inference_mode()
def row_gap(target, *, prompt_len: int = 40, rows: int = 17, seed: int = 0) -> float:
    """Max |logit difference| over `rows` tokens between one verification-shaped forward of all of them
    and the same tokens decoded one per forward: 0.0 means a row's logits do not depend on how many rows
    its forward holds (exact speculation by construction, at this precision and these kernels)."""
    from ..kv_cache import causal_mask

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.cfg.vocab_size, (1, prompt_len + rows), generator=g)
    ids = ids.to(next(target.parameters()).device)
    cache = target.new_cache(1, max_length=prompt_len + rows + 1)

    def forward(start: int, t: int, last_only: bool = False) -> torch.Tensor:
        meta = cache.prepare(None, causal_mask(torch.tensor([t]), t))
        h, _ = target(ids[:, start : start + t], meta.write_pos, cache, meta, capture_aux=False, last_only=last_only)
        return target.logits(h[:, -1:] if last_only else h)[0].float()

    for start in range(0, prompt_len, PROBE_CHUNK):  # the context, in chunks as the engine prefills
        t = min(PROBE_CHUNK, prompt_len - start)
        forward(start, t, last_only=True)
        cache.commit(None, torch.tensor([t]))
    together = forward(prompt_len, rows)  # not committed: the next prepare discards it
    apart = []
    for i in range(rows):
        apart.append(forward(prompt_len + i, 1)[0])
        cache.commit(None, torch.tensor([1]))
    return float((together - torch.stack(apart)).abs().max())
