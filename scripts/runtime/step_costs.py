"""Step costs of the target runtimes on one model, for BENCHMARKS.md "Target runtimes" (issue 31's measurement).

For each runtime and precision: is a verification row bit-identical to a one-token step (models/precision.row_gap,
after a 40- and a 600-token context), and the milliseconds of a target forward over 1, 5, 9 and 17 rows with
logits at every row, at 40 and 800 tokens of context; then the drafter's cost (one extend + a chain of 4 or the
default tree; its layer in PyTorch or in llama.cpp). Run alone on the machine (nothing else on the cores):
    python scripts/runtime/step_costs.py [--target SmolLM2 .gguf] [--out docs/runtime/step_costs.md]
Needs llama.cpp's shared library (scripts/llamacpp/build.sh) for the llama.cpp rows."""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from pathlib import Path

import torch

from eaglespec.api import drafter_on_runtime, load_drafter_for
from eaglespec.export.llamacpp_convert import convert_target, quantize_gguf
from eaglespec.kv_cache import causal_mask
from eaglespec.models.checkpoint import load_target
from eaglespec.models.fast_linear import prepare_for_inference
from eaglespec.models.gguf import gguf_folder
from eaglespec.models.llamacpp.library import llamacpp_root
from eaglespec.models.llamacpp.target import load_exact
from eaglespec.models.precision import row_gap
from eaglespec.models.quantize import apply_quantize
from eaglespec.settings import SMOLLM2_DRAFTERS, default_models_dir, smollm2_gguf
from eaglespec.speculation.config import TreeShape
from eaglespec.speculation.proposer import EagleProposer, FixedShape

ROWS = (1, 5, 9, 17)
CONTEXTS = (40, 800)


def best_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


@torch.inference_mode()
def forward_costs(target, contexts=CONTEXTS, rows=ROWS) -> dict:
    """{(context, rows): best ms of one forward over `rows` tokens with logits at every row after `context`}."""
    out = {}
    for ctx in contexts:
        cache = target.new_cache(1, max_length=ctx + max(rows) + 1)
        ids = torch.randint(0, target.cfg.vocab_size, (1, ctx + max(rows)), generator=torch.Generator().manual_seed(0))
        meta = cache.prepare(None, causal_mask(torch.tensor([ctx]), ctx))
        target(ids[:, :ctx], meta.write_pos, cache, meta, capture_aux=True, last_only=True)
        cache.commit(None, torch.tensor([ctx]))
        for n in rows:
            def run(n=n, cache=cache, ids=ids, ctx=ctx):
                meta = cache.prepare(None, causal_mask(torch.tensor([n]), n))
                h, _ = target(ids[:, ctx : ctx + n], meta.write_pos, cache, meta, capture_aux=True)
                target.logits(h).argmax(-1)

            out[(ctx, n)] = best_ms(run)
    return out


@torch.inference_mode()
def drafter_costs(target, folder, drafter_dir, runtime: str) -> dict:
    drafter, _ = drafter_on_runtime(load_drafter_for(target, drafter_dir), target, folder, runtime, "torch")
    if drafter.embed_tokens is None:  # as the engine does: the drafter shares the target's embedding
        drafter.attach_target_embedding(target.model.embed_tokens)
    proposer = EagleProposer(drafter)
    aux_width = len(target.aux_layers) * target.cfg.hidden_size
    out = {}
    for name, shape in (("chain 4", TreeShape(4, 1, 4)), ("tree d4/k4/16", TreeShape(4, 4, 16))):
        cache = drafter.new_cache(1, max_length=256)
        ids, aux = torch.randint(0, 1000, (1, 40)), torch.randn(1, 40, aux_width)
        proposer.extend(cache, None, ids, aux, torch.tensor([40]))

        def run(shape=shape, cache=cache, ids=ids, aux=aux):
            cache.lengths[0] = 40
            logits, state = proposer.extend(cache, None, ids[:, :1], aux[:, :1], torch.tensor([1]))
            proposer.propose(cache, None, ids[:, 0], logits, state, shape=FixedShape(shape))

        out[name] = best_ms(run, repeats=15)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="a .gguf target (default: SmolLM2-135M-Instruct's Q4_1 file)")
    p.add_argument("--out", default="docs/runtime/step_costs.md")
    args = p.parse_args()
    gguf = Path(args.target) if args.target else smollm2_gguf()
    folder = gguf_folder(gguf)
    root = llamacpp_root()
    f32 = convert_target(root, folder, "f32")
    def torch_target(scheme=None, group=None):  # as the engine runs it: quantized, linears fused and packed
        return prepare_for_inference(apply_quantize(load_target(folder), scheme, group))

    runs = [("PyTorch", "fp32", torch_target),
            ("PyTorch", "int8 (weight-only)", lambda: torch_target("int8")),
            ("PyTorch", "int4 (group 64)", lambda: torch_target("int4", 64)),
            ("llama.cpp", "F32", lambda: load_exact(f32, folder)[0]),
            ("llama.cpp", "Q8_0", lambda: load_exact(convert_target(root, folder, "q8_0"), folder)[0]),
            ("llama.cpp", "Q4_0", lambda: load_exact(quantize_gguf(root, f32, "q4_0"), folder)[0]),
            ("llama.cpp", f"{gguf.name} (as shipped)", lambda: load_exact(gguf, folder)[0])]  # fmt: skip
    head = " | ".join(f"{n} rows @{c}" for c in CONTEXTS for n in ROWS)
    lines = [f"| runtime | weights | row gap | {head} |", "|---|---|---:|" + "---:|" * len(CONTEXTS) * len(ROWS)]
    drafter_line = ""
    for runtime, weights, load in runs:
        target = load()
        gap = max(row_gap(target), row_gap(target, prompt_len=600, seed=1))
        costs = forward_costs(target)
        extra = " (two-row steps)" if getattr(target, "min_rows", 1) > 1 else ""
        cells = " | ".join(f"{costs[(c, n)]:.1f}" for c in CONTEXTS for n in ROWS)
        lines.append(f"| {runtime} | {weights}{extra} | {gap:.2g} | {cells} |")
        print(lines[-1], flush=True)
        if runtime == "PyTorch" and weights == "fp32":
            drafter_dir = default_models_dir() / SMOLLM2_DRAFTERS / "drafter-eagle3.1"
            parts = []
            for where, runtime in (("PyTorch", "torch"), ("llama.cpp (its EAGLE-3 graph)", "llamacpp")):
                d = drafter_costs(target, folder, drafter_dir, runtime)
                parts.append(f"{where}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in d.items()))
            drafter_line = "; ".join(parts)
        del target
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    text = (f"# Target step costs ({gguf.name})\n\n`python scripts/runtime/step_costs.py`; {model}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.python_version()}.\n"
            "Milliseconds of one target forward (best of 7) over n rows with logits at every row, after 40 or 800 "
            "tokens of context; row gap: max |logit difference| between a 17-row verification and one-token steps "
            "(0 = exact by construction).\n\n" + "\n".join(lines) +
            f"\n\nDrafter (EAGLE-3.1; its layer in fp32 PyTorch or f16 llama.cpp), one extend + propose (best of 15): "
            f"{drafter_line}.\n")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
