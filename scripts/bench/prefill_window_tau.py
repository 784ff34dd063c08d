"""Tau per suite for drafter prefill windows (tree d4/k4/16 forced, 6 prompts per suite, 48 new tokens).
Usage: python scripts/bench/prefill_window_tau.py 32,128,256"""
import sys
import time

import torch

from eaglespec.api import load_engine, stop_ids_for
from eaglespec.engine import Request
from eaglespec.suites import load_suite, tokenize_suite

torch.set_num_threads(2)
eng = load_engine("models/target", "models/drafter-eagle3.1", mode="tree", dtype="fp32", adaptive=False)
cats = ("chat", "code", "docs_qa", "summarization", "long_context")
for W in [None] + [int(x) for x in sys.argv[1].split(",")]:
    eng.configure(draft_prefill_window=W or 0)
    res = []
    for c in cats:
        ps = [p.ids for p in tokenize_suite(load_suite(c), c, eng.tokenizer)][:6]
        out = eng.generate([Request(p, 48, stop_ids_for(eng), ()) for p in ps])
        st = out.stats
        res.append(f"{c} {st.tau:.2f}" if hasattr(st,'tau') else str(st))
    print(W, " | ".join(res), flush=True)
