"""Target step time eager vs torch.compile'd, per quantization scheme: one-token plain steps and 5- and
17-token verification forwards (context 128, nothing committed), eager and compiled rounds interleaved
(shared VMs drift), plus compile time and the compiled model's plain/verification logit gap.

    python scripts/bench/compiled_quant.py --target DIR --schemes w8a8,int8,int4,none [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from eaglespec.api import load_target_for_speculation
from eaglespec.kv_cache import causal_mask
from eaglespec.machine import cpu_name
from eaglespec.models.compiled import compile_model, is_compiled, uncompile
from eaglespec.models.fast_linear import prepare_for_inference
from eaglespec.models.precision import tree_plain_gap

ROWS = (1, 5, 17)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--schemes", default="w8a8,int8,int4,none")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(2)
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, 2 threads; {args.target}; ms per forward, "
          f"best of {args.rounds} interleaved rounds of {args.steps}\n")
    print("| scheme | compile s | compiled gap | " + " | ".join(f"{n} rows eager / compiled ms (ratio)" for n in ROWS) + " |")
    print("|---|---:|---:|" + "---:|" * len(ROWS))
    for scheme in args.schemes.split(","):
        quantize = None if scheme == "none" else scheme
        target, _, _ = load_target_for_speculation(args.target, dtype="fp32", quantize=quantize)
        prepare_for_inference(target)
        eager_forward = target.forward
        cache = target.new_cache(1, max_length=400)
        ids = torch.randint(0, target.cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))

        def step(n):
            meta = cache.prepare(None, causal_mask(torch.tensor([n]), n))
            h, _ = target(ids[:, 200 : 200 + n], meta.write_pos, cache, meta, capture_aux=False)
            return target.logits(h[:, -1:])

        def prefill():
            meta = cache.prepare(None, causal_mask(torch.tensor([128]), 128))
            target(ids[:, :128], meta.write_pos, cache, meta, capture_aux=False)
            cache.commit(None, torch.tensor([128]))

        with torch.inference_mode():
            prefill()
            t0 = time.perf_counter()
            compile_model(target)
            for n in ROWS:
                step(n)
            compile_s = time.perf_counter() - t0
            gap = tree_plain_gap(target)
            best = {(c, n): float("inf") for c in (False, True) for n in ROWS}
            for _ in range(args.rounds):
                for compiled in (False, True):
                    if compiled and not is_compiled(target):
                        compile_model(target)
                    elif not compiled:
                        uncompile(target)
                        assert target.forward == eager_forward
                    for n in ROWS:
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            step(n)
                        best[compiled, n] = min(best[compiled, n], (time.perf_counter() - t0) / args.steps)
        cells = [f"{best[False, n] * 1e3:.1f} / {best[True, n] * 1e3:.1f} ({best[False, n] / best[True, n]:.2f}x)"
                 for n in ROWS]  # fmt: skip
        print(f"| {scheme} | {compile_s:.0f} | {gap:.2g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
