"""Exact int8 x int8 matmuls on CPU for W8A8 layers (models/quantized_linear.py), and the choice among them.

Kernels: oneDNN's prepacked u8s8 linear, torch._int_mm (both exact where the CPU has VNNI/AMX), and a
chunked fp32 GEMM that is exact on any CPU. `exact_int8_kernels` checks exactness with extreme codes,
since CPUs without VNNI/AMX saturate pairs of u8 x s8 products in int16; every exact kernel gives the
same bits. `fastest_int8_kernels` times them on a weight's shape, for one-row calls (plain steps) and
for more rows (verification), and caches the choice per machine (machine.read_cached/write_cached);
their cost stays nearly flat from 1 to 17 rows (BENCHMARKS.md, Quantized targets, `scripts/bench/quant_kernels.py`).
Compiled graphs (models/compiled.py) call the oneDNN kernel through the `eaglespec::int8_matmul` custom
op, since inductor cannot trace its packed weight. `quantize_rows` rounds activations row by row to the
int8 steps these kernels take; every kernel here is row-invariant (a row's bits do not depend on the
rows beside it).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

# int8 x int8 -> exact sums on CPU: oneDNN's prepacked u8s8 linear and torch._int_mm (exact where the CPU
# has VNNI/AMX), and an fp32 GEMM over chunks of EXACT_FP32_K input channels, exact on any CPU (every
# partial sum is an integer below 2**24), at dense fp32 speed and with an fp32 copy of the codes
INT8_KERNELS = ("onednn", "int_mm", "fp32")
EXACT_FP32_K = 1024  # 1024 * 127 * 127 < 2**24
INT8_KERNEL_CACHE = "int8_kernels.json"  # in machine.cache_dir()
STREAMED_BYTES = 64 * 2**20  # kernel timing streams at least this much weight (beyond a CPU's last-level cache)


def int8_matmul(name: str, codes: torch.Tensor, scales: torch.Tensor):
    """Rows rounded by quantize_rows in this kernel's ROW_FORMAT -> fp32 [m, n] = float(rows @ codes.T,
    summed exactly) * scales: every kernel gives the same bits."""
    if name == "onednn":
        packed = torch.ops.onednn.qlinear_prepack(codes, None)
        zero = torch.zeros(codes.shape[0], dtype=torch.int64)
        return lambda q: torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 128, packed, scales, zero, None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip
    if name == "int_mm":
        codes_t = codes.t()
        return lambda q: torch._int_mm(q, codes_t).float() * scales
    chunks = [(i, codes[:, i : i + EXACT_FP32_K].float()) for i in range(0, codes.shape[1], EXACT_FP32_K)]
    if len(chunks) == 1:
        return lambda q: F.linear(q, chunks[0][1]) * scales

    def chunked(q):
        acc = sum(F.linear(q[:, i : i + EXACT_FP32_K], w).to(torch.int32) for i, w in chunks)
        return acc.float() * scales

    return chunked


ROW_FORMAT = {"onednn": "u8", "int_mm": "s8", "fp32": "f32"}  # how each kernel takes the rounded rows

# oneDNN matmuls of compiled W8A8 layers, called from the graphs through one custom op (inductor cannot
# trace the packed weight, and compiling failed with it inlined): weak, so a dropped model frees them
_OPAQUE: list[tuple[weakref.ref, int]] = []


@torch.library.custom_op("eaglespec::int8_matmul", mutates_args=())
def _opaque_int8_matmul(rows: torch.Tensor, index: int) -> torch.Tensor:
    return _OPAQUE[index][0]()(rows)


@_opaque_int8_matmul.register_fake
def _(rows: torch.Tensor, index: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], _OPAQUE[index][1]), dtype=torch.float32)


def as_custom_op(run, out_features: int):
    """`run` ([m, in] rounded rows -> fp32 [m, out]) as a call torch.compile keeps as it is."""
    _OPAQUE.append((weakref.ref(run), out_features))
    index = len(_OPAQUE) - 1

    def opaque(rows):
        return _opaque_int8_matmul(rows, index)

    opaque.run = run  # the weak reference's target lives as long as the layer's kernel
    return opaque


def as_format(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Float codes in [-127, 127] -> "u8" (codes + 128, uint8: oneDNN), "s8" (int8: int_mm) or "f32".
    Consumes `codes` (offset in place: a fresh tensor from every caller, no extra copy per call)."""
    if fmt == "u8":
        return codes.add_(128).to(torch.uint8)
    return codes.to(torch.int8) if fmt == "s8" else codes


@functools.cache
def exact_int8_kernels() -> tuple[str, ...]:
    """The int8 kernels whose sums are exact here at 1, 5 and 17 rows (so they agree bit for bit), tried
    with the largest codes (where CPUs without VNNI/AMX saturate pairs of u8 x s8 products in int16) and
    more input channels than one fp32 chunk."""
    g = torch.Generator().manual_seed(0)
    k, n = EXACT_FP32_K + 256, 48
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[:, :64] = 127
    x = torch.randint(-127, 128, (17, k), generator=g, dtype=torch.int8)
    x[:, :64] = 127
    x[1::2, :64] = -127
    scales = torch.rand(n, generator=g) * 0.01
    exact = (x.double() @ w.double().T).float() * scales  # as float(int32 sum) * scale
    found = []
    for name in INT8_KERNELS:
        try:
            run, rows = int8_matmul(name, w, scales), as_format(x.float(), ROW_FORMAT[name])
            checks = [(rows[:m], exact[:m]) for m in (1, 5, 17)] + [(rows[3:4], exact[3:4])]
            if all(torch.equal(run(r), want) for r, want in checks):
                found.append(name)
        except (RuntimeError, AttributeError):
            continue
    return tuple(found)


@functools.cache
def fastest_int8_kernels(shape: tuple[int, int]) -> tuple[str, str]:
    """Of the exact kernels, the fastest here for an [out, in] weight for one-row calls (plain steps) and
    for 4- and 17-row calls (verification). They give the same bits, so a layer may use one for plain
    steps and another for verification. Measured on a 2-vCPU EPYC: int_mm wins one-row calls on most
    weights, oneDNN many-row calls and the largest weights (BENCHMARKS.md, Quantized targets)."""
    from ..machine import best_seconds, cpu_name, read_cached, write_cached

    names = exact_int8_kernels() or ("fp32",)
    if len(names) < 2:
        return names[0], names[0]
    # cached on disk per machine: timing a 365M model's four shapes takes seconds at every start
    key = f"{cpu_name()}|{torch.get_num_threads()}|{torch.__version__}|{','.join(names)}|{shape[0]}x{shape[1]}"
    hit = read_cached(INT8_KERNEL_CACHE).get(key)
    if isinstance(hit, list) and len(hit) == 2 and all(h in names for h in hit):
        return hit[0], hit[1]
    g = torch.Generator().manual_seed(0)
    # distinct copies of the weight, as a model's layers are, so a large weight streams from memory as
    # it does in decoding (one copy would be timed from cache and favour the wrong kernel)
    copies = max(1, min(24, -(-STREAMED_BYTES // (shape[0] * shape[1]))))
    ws = [torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(copies)]
    xs = [torch.randint(-127, 128, (m, shape[1]), generator=g).float() for m in (1, 4, 17)]
    one, many = {}, {}
    for name in names:
        runs = [int8_matmul(name, w, torch.ones(shape[0])) for w in ws]
        rows = [as_format(x.clone(), ROW_FORMAT[name]) for x in xs]
        one[name] = best_seconds(lambda runs=runs, r=rows[0]: [run(r) for run in runs], 5)
        many[name] = best_seconds(lambda runs=runs, rows=rows[1:]: [run(r) for run in runs for r in rows], 5)
    chosen = (min(one, key=one.get), min(many, key=many.get))
    write_cached(INT8_KERNEL_CACHE, key, list(chosen))
    return chosen


def quantize_rows(x: torch.Tensor, fmt: str = "u8") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric int8: (codes [m, k], scale fp32 [m, 1]) with x ~ codes * scale, codes in
    [-127, 127] = round(x * 127 / amax) (vLLM's scaled_int8_quant rounds the same way), returned as
    fmt "u8" (codes + 128, uint8), "s8" (int8) or "f32" (float). Each row's codes depend on that row only."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp_(min=1e-30)
    return as_format(torch.round(xf * (127 / amax)), fmt), amax / 127
