"""Closed-loop load on the engine core without HTTP: keep C requests in flight (64 new tokens each, the
serving benchmark's prompts), plain and auto engines alternated in one process, median of R runs.
Isolates the engine and policy from the server and the load generator. Usage:
    python scripts/bench/engine_load.py 1,4,16,64 3
"""

import statistics
import sys
import time

import torch

from eaglespec.api import load_engine, stop_ids_for
from eaglespec.engine import Request
from eaglespec.suites import load_suite, tokenize_suite

CATEGORIES = ("chat", "code", "docs_qa", "summarization")


def run(engine, prompts, stops, concurrency: int, n: int):
    core = engine.new_core(max_num_seqs=64)
    sent = done = tokens = 0
    t0 = time.perf_counter()
    while done < n:
        while sent < n and sent - done < concurrency:
            core.add_request(Request(prompts[sent % len(prompts)], 64, stops, ()))
            sent += 1
        for o in core.step():
            tokens += len(o.new_token_ids)
            done += o.finished
    return tokens / (time.perf_counter() - t0), core.stats


def main() -> None:
    levels = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 16, 64]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(2)
    engines = {"plain": load_engine("models/target", None, mode="off", dtype="fp32"),
               "auto": load_engine("models/target", "models/drafter-eagle3.1", mode="auto", dtype="fp32")}  # fmt: skip
    engines["auto"].prepare_policies(64)
    tok = engines["plain"].tokenizer
    prompts = [p.ids for c in CATEGORIES for p in tokenize_suite(load_suite(c), c, tok)]
    stops = stop_ids_for(engines["plain"])
    print("| concurrency | plain tok/s | auto tok/s | auto / plain |\n|---:|---:|---:|---:|")
    for c in levels:
        n = max(8, 2 * c)
        for e in engines.values():
            run(e, prompts, stops, c, min(n, 2 * c))  # warm-up
        rates = {name: [] for name in engines}
        for _ in range(repeats):
            for name, e in engines.items():
                rates[name].append(run(e, prompts, stops, c, n)[0])
        med = {name: statistics.median(v) for name, v in rates.items()}
        print(f"| {c} | {med['plain']:.0f} | {med['auto']:.0f} | {med['auto'] / med['plain']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
