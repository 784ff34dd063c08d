"""Survey of the weight-only quantized matmul kernels in the pinned torch on this CPU (issue 12):
time per call at 1, 4 and 17 rows (a plain step, a small and a 16-node tree verification) against
dense F.linear, row invariance (a row's result must not depend on how many rows share the call, or
speculative and plain decoding of the same quantized target could differ), error against a
dequantize-then-matmul reference, and weight bytes (scales included) relative to fp32.

    python scripts/bench/quant_kernels.py [--shapes 365m|bundled] [--threads 2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from eaglespec.machine import best_seconds, cpu_name

SHAPES = {  # (out, in) of the matmuls of one decoder layer, qkv and gate/up fused as the engine runs them
    "365m": [(1152, 896), (896, 896), (9728, 896), (896, 4864)],
    "bundled": [(768, 256), (256, 256), (1536, 256), (256, 768)],
}
ROWS = (1, 4, 17)


def int8_kernel(w: torch.Tensor, dtype):
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    s = scale.to(dtype)
    ref = q.float() * scale[:, None]
    return (lambda x: torch._weight_int8pack_mm(x, q, s)), ref, q.numel() + 4 * scale.numel()


def int4_kernel(w: torch.Tensor, dtype, group: int):
    n, k = w.shape
    wg = w.view(n, k // group, group)
    low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    q = torch.round((wg - low) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel computes (q - 8) * scale + zero per group
    sz = torch.stack([scale.view(n, -1), (low + 8 * scale).view(n, -1)], -1).transpose(0, 1).contiguous().to(dtype)
    ref = (q.view(n, k // group, group).float() * scale + low).view(n, k)
    run = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)  # noqa: E731
    return run, ref, packed.numel() + 2 * 4 * scale.numel()


def dense_kernel(w: torch.Tensor, dtype):
    wd = w.to(dtype)
    return (lambda x: F.linear(x, wd)), w.to(dtype).float(), wd.numel() * wd.element_size()


def row_invariant(fn, x) -> bool:
    full = fn(x)
    return all(torch.equal(fn(x[:m]), full[:m]) for m in ROWS[:-1]) and torch.equal(fn(x[3:4]), full[3:4])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="365m", choices=sorted(SHAPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=g) * 0.02 for s in SHAPES[args.shapes]]
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    lines = [f"CPU: {cpu_name()}, torch {torch.__version__}, {args.threads} threads; shapes {args.shapes} "
             f"{SHAPES[args.shapes]} (one layer, times summed over its matmuls, best of 20)", "",
             "| kernel | activations | " + " | ".join(f"{m} row(s) us" for m in ROWS) +
             " | 17 rows / 1 row | row-invariant | max err vs dequant ref | weight bytes / fp32 |",
             "|---|---|" + "---:|" * len(ROWS) + "---:|---|---:|---:|"]  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        kernels = {"dense F.linear": lambda w, dt=dtype: dense_kernel(w, dt),
                   "int8 _weight_int8pack_mm": lambda w, dt=dtype: int8_kernel(w, dt)}  # fmt: skip
        for group in (32, 128):
            kernels[f"int4 g{group} _weight_int4pack_mm_for_cpu"] = lambda w, dt=dtype, gr=group: int4_kernel(w, dt, gr)
        for name, make in kernels.items():
            try:
                built = [make(w) for w in weights]
            except RuntimeError as e:
                lines.append(f"| {name} | {str(dtype)[6:]} | unavailable: {str(e).splitlines()[0][:80]} |")
                continue
            times, invariant, err = [], True, 0.0
            for m in ROWS:
                xs = [torch.randn(m, w.shape[1], generator=g).to(dtype) for w in weights]
                times.append(sum(best_seconds(lambda fn=fn, x=x: fn(x), 20) for (fn, _, _), x in zip(built, xs)))
            for (fn, ref, _), w in zip(built, weights):
                x = torch.randn(17, w.shape[1], generator=g).to(dtype)
                invariant &= row_invariant(fn, x)
                err = max(err, float((fn(x).float() - x.float() @ ref.t()).abs().max()))
            size = sum(b for _, _, b in built) / fp32_bytes
            cells = [f"{t * 1e6:.0f}" for t in times] + [f"{times[-1] / times[0]:.1f}x", "yes" if invariant else "NO",
                                                         f"{err:.2g}", f"{size:.3f}"]  # fmt: skip
            lines.append(f"| {name} | {str(dtype)[6:]} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
