"""Survey of the quantized matmul kernels in the pinned torch on this CPU (issue 12): time per layer
at 1, 4 and 17 rows (a plain step, a small and a 16-node tree verification) against dense F.linear,
row invariance (a row's result must not depend on how many rows share the call, or speculative and
plain decoding of the same quantized target could differ), error against a dequantize-then-matmul
reference, and weight bytes (scales included) relative to fp32. Kernels: torch's weight-only int8 and
int4, and eaglespec's W8A8 layer (models/quantized_linear.py: per-row int8 activations, oneDNN u8s8, the row
rounding included in its time). Each timed pass runs `--layers` distinct copies of the layer, as a
model's forward does, so weights come from memory, not from a cache that holds one layer.

    python scripts/bench/quant_kernels.py [--shapes 365m|bundled] [--layers 24] [--threads 2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from eaglespec.machine import best_seconds, cpu_name
from eaglespec.models.int8_kernels import quantize_rows
from eaglespec.models.quantized_linear import QuantizedLinear

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


def w8a8_kernel(w: torch.Tensor, dtype):
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data.copy_(w)
    layer = QuantizedLinear.from_linear(linear, 8, activations="int8")
    deq = layer.dequantized_weight()

    def ref_mm(x):  # the exact integer products of the rounded rows, in float64
        q, scale = quantize_rows(x)
        return (((q.double() - 128) @ layer.codes.double().T) * layer.scales.double() * scale.double()).float()

    return layer, (deq, ref_mm), layer.weight_bytes()


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
    p.add_argument("--layers", type=int, default=None,
                   help="distinct copies of the layer per timed pass (default: 24 for 365m, 8 for bundled)")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n_layers = args.layers or (24 if args.shapes == "365m" else 8)
    copies = [[torch.randn(*s, generator=g) * 0.02 for s in SHAPES[args.shapes]] for _ in range(n_layers)]
    weights = copies[0]
    fp32_bytes = sum(w.numel() * 4 for w in weights)
    lines = [f"CPU: {cpu_name()}, torch {torch.__version__}, {args.threads} threads; shapes {args.shapes} "
             f"{SHAPES[args.shapes]} (us per layer: a pass over {n_layers} distinct copies of the layer's matmuls "
             "divided by the copies, best of 5)", "",
             "| kernel | activations | " + " | ".join(f"{m} row(s) us" for m in ROWS) +
             " | 17 rows / 1 row | row-invariant | max err vs dequant ref | weight bytes / fp32 |",
             "|---|---|" + "---:|" * len(ROWS) + "---:|---|---:|---:|"]  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        kernels = {"dense F.linear": lambda w, dt=dtype: dense_kernel(w, dt),
                   "int8 _weight_int8pack_mm": lambda w, dt=dtype: int8_kernel(w, dt)}  # fmt: skip
        for group in (32, 128):
            kernels[f"int4 g{group} _weight_int4pack_mm_for_cpu"] = lambda w, dt=dtype, gr=group: int4_kernel(w, dt, gr)
        kernels["W8A8 eaglespec (int8 rows, exact int8 kernels)"] = lambda w, dt=dtype: w8a8_kernel(w, dt)
        for name, make in kernels.items():
            try:
                built_all = [[make(w) for w in layer] for layer in copies]
            except RuntimeError as e:
                lines.append(f"| {name} | {str(dtype)[6:]} | unavailable: {str(e).splitlines()[0][:80]} |")
                continue
            built = built_all[0]
            times, invariant, err = [], True, 0.0
            for m in ROWS:
                xs = [torch.randn(m, w.shape[1], generator=g).to(dtype) for w in weights]

                def one_pass(xs=xs, built_all=built_all):
                    for layer in built_all:
                        for (fn, _, _), x in zip(layer, xs):
                            fn(x)

                times.append(best_seconds(one_pass, 5) / n_layers)
            for (fn, ref, _), w in zip(built, weights):
                x = torch.randn(17, w.shape[1], generator=g).to(dtype)
                invariant &= row_invariant(fn, x)
                want = ref[1](x) if isinstance(ref, tuple) else x.float() @ ref.t()
                err = max(err, float((fn(x).float() - want).abs().max()))
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
