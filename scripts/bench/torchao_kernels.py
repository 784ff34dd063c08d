"""torchao's CPU quantized linears on the 365M layer shapes, for comparison with ours (issue 12 asks to use
torchao where it installs and runs with the pinned torch on CPU). torchao is not a dependency: run this in
a separate venv, `pip install torch==2.13.0 torchao`. Same timing as quant_kernels.py: us per matmul, a pass
over 24 distinct copies divided by 24, best of 5, at 1 and 17 rows.

    python scripts/bench/torchao_kernels.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (out, in), q/k/v and gate/up fused
CONFIGS = ("Int8DynamicActivationInt8WeightConfig", "Int8WeightOnlyConfig", "Int4WeightOnlyConfig")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import torchao
    import torchao.quantization as tq

    print(f"torchao {torchao.__version__}, torch {torch.__version__}, {args.threads} threads")
    for name in CONFIGS:
        per_layer = [0.0, 0.0]
        for n, k in SHAPES:
            layers = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False) for _ in range(24))
            try:
                tq.quantize_(layers, getattr(tq, name)())
            except Exception as e:  # noqa: BLE001 - report whatever torchao refuses with
                print(f"{name}: unavailable ({str(e).splitlines()[0][:100]})")
                break
            for i, rows in enumerate((1, 17)):
                x = torch.randn(rows, k)
                best = float("inf")
                for _ in range(6):
                    t = time.perf_counter()
                    for layer in layers:
                        layer(x)
                    best = min(best, time.perf_counter() - t)
                per_layer[i] += best / 24 * 1e6
                print(f"{name} {(n, k)} {rows} row(s): {best / 24 * 1e6:.0f} us", flush=True)
        else:
            print(f"{name}: one decoder layer {per_layer[0]:.0f} us at 1 row, {per_layer[1]:.0f} us at 17 rows")


if __name__ == "__main__":
    main()
