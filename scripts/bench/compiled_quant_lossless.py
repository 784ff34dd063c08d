"""Compiled W8A8 bundled pair: compiled speculation (auto/chain/tree) vs compiled plain, and compiled plain vs
eager plain, 6 prompts x 48 tokens. python scripts/bench/compiled_quant_lossless.py"""

import time

import torch

from eaglespec.api import load_engine
from eaglespec.engine import Engine, Request
from eaglespec.models import compiled

torch.set_num_threads(2)
t0 = time.time()
eng = load_engine("models/target", "models/drafter-eagle3.1", quantize="w8a8", compile="on", dtype="fp32")
print("compiled:", eng.compiled, f"{time.time()-t0:.0f}s", flush=True)
tok = eng.tokenizer
texts = ["Explain Python decorators.", "The history of Rome", "Write a haiku about rain.", "def fibonacci(n):",
         "What is the capital of France?", "Once upon a time"]
reqs = [Request(tok.encode(t), 48) for t in texts]
plain = [r.output_ids for r in Engine(eng.target, None, mode="off").generate(reqs).results]
for mode in ("auto", "chain", "tree"):
    e = Engine(eng.target, eng.drafter, mode=mode, adaptive=False)
    out = [r.output_ids for r in e.generate(reqs).results]
    print(mode, "compiled spec == compiled plain:", out == plain, sum(a != b for a, b in zip(out, plain)), flush=True)
for m in (eng.target, eng.drafter):
    compiled.uncompile(m)
eager = [r.output_ids for r in Engine(eng.target, None, mode="off").generate(reqs).results]
print("compiled plain == eager plain:", eager == plain, sum(a != b for a, b in zip(eager, plain)), flush=True)
