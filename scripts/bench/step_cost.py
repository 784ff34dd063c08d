"""Time one target step of 1 and 17 tokens (context 200, 50 steps, best of 5) with the matmul kernels
chosen for this machine (models/fast_linear.py) or with oneDNN packing forced on every linear.

    python scripts/bench/step_cost.py [--target models/target] [--dtype fp32|bf16] [--kernels measured|packed]
"""

from __future__ import annotations

import argparse
import time

import torch

import eaglespec.models.fast_linear as fast_linear
from eaglespec.kv_cache import causal_mask
from eaglespec.models.checkpoint import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="models/target")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--kernels", default="measured", choices=["measured", "packed"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.kernels == "packed":
        fast_linear._packing_pays = lambda shape, dtype: True
    target = load_target(args.target, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    fast_linear.prepare_for_inference(target)
    cache = target.new_cache(1, max_length=400)
    ids = torch.randint(0, target.cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        meta = cache.prepare(None, causal_mask(torch.tensor([200]), 200))
        target(ids[:, :200], meta.write_pos, cache, meta, capture_aux=False)
        cache.commit(None, torch.tensor([200]))
        for n in (1, 17):
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(50):  # nothing committed: every step sees the same context
                    meta = cache.prepare(None, causal_mask(torch.tensor([n]), n))
                    h, _ = target(ids[:, 200 : 200 + n], meta.write_pos, cache, meta, capture_aux=False)
                    target.logits(h[:, -1:])
                best = min(best, (time.perf_counter() - t0) / 50)
            print(f"{args.dtype} kernels={args.kernels} ({fast_linear.kernel_signature(target)}) "
                  f"{n:2d} tokens: {best * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
