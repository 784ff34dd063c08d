import sys
import time

import torch

from eaglespec.api import generate, load_engine

torch.set_num_threads(2)
p=None
for dtype in ["fp32","bf16"]:
  for mode in ["off","tree","auto"]:
    eng = load_engine("models/target", "models/drafter-eagle3.1", mode=mode, dtype=dtype)
    if mode=="tree": eng.configure(adaptive=False)
    if p is None:
        p = eng.tokenizer.apply_chat_template([{"role":"user","content":"How are you today? Tell me about python lists."}], add_generation_prompt=True, tokenize=True)
        if hasattr(p,"keys"): p=p["input_ids"]
        p=list(p)
    generate(eng,[p],max_new_tokens=16)
    best=0
    for _ in range(3):
        t=time.perf_counter(); out=generate(eng,[p],max_new_tokens=64); dt=time.perf_counter()-t
        best=max(best,out.stats.new_tokens/dt)
    s=out.stats
    print(dtype, mode, s.new_tokens, f"{best:.1f} tok/s", f"tau {s.tau:.2f}", f"draft {s.time_draft:.3f} verify {s.time_verify:.3f} other {s.time_other:.3f} fwd {s.target_forwards}", eng.policy.summary() if eng.policy else "")
