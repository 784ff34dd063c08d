"""Row-invariant attention for targets on CPU: exact speculation by construction (issue 31).

PyTorch's SDPA computes a query row with other kernels (and so other summation orders) at 1 query row than
at 17, and a tree node's visible keys lie among masked siblings: its logits came out ~5e-5 from the
one-token step's on SmolLM2, enough to flip a near-tied token. `row_attention.cpp` gives every query row
its own list of visible cache columns (from the step's mask, in column order) and computes the row from
that list alone: a tree node's list is the committed prefix plus its ancestors, the very keys, values and
order of the one-token step that decodes it, so both give the same bits; with the row-invariant linears
(models/fast_linear.py) the whole forward is. Used for steps of at most MAX_ROWS query rows (one-token
steps and verifications; longer prefill chunks keep SDPA, which plain and speculative decoding share).

The kernel is compiled once per machine on first use (torch.utils.cpp_extension, ~1 min, cached in
torch's extension folder); without a compiler targets fall back to SDPA, fp32 rows then agree only to
~5e-5 (models/precision.py) and quantized ones attend in fp64. Measured (2-vCPU EPYC, one thread, one
layer of SmolLM2's 9/3 heads): ~9 ns per (query, visible key) pair against SDPA's ~4 ns at 17 rows and
~10 ns at one row.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("row_attention.cpp")
MAX_ROWS = 64  # query rows per step up to which the kernel runs (trees and one-token steps)
_NO_MASK = torch.empty(0, dtype=torch.bool)


@functools.cache
def _load() -> tuple[object | None, str | None]:
    """(extension, None), or (None, why not)."""
    if os.environ.get("EAGLESPEC_ROW_ATTENTION", "1") == "0":
        return None, "EAGLESPEC_ROW_ATTENTION=0"
    from torch.utils.cpp_extension import _get_build_directory, load

    name = f"eaglespec_row_attention_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"
    if not any(Path(_get_build_directory(name, verbose=False)).glob(f"{name}*.so")):
        print("[eaglespec] row-invariant attention kernel: compiling once for this machine (~1 min)...",
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        ext = load(name, [str(SOURCE)], extra_cflags=["-O3", "-march=native"])
    except Exception as e:  # no compiler or ninja, a failed build: SDPA stays
        return None, f"could not compile {SOURCE.name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return ext, None


def unavailable_reason() -> str | None:
    """None when the kernel runs here, else why not."""
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, start: int, span: int,
           mask: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """q [B, heads, T, hd] over one layer's cache [slots, kv_heads, L, hd] (fp32, CPU): rows [B] slot per row,
    columns start..span-1, mask [B, 1, T, span - start] (None: every query sees them all) -> [B, heads, T, hd]."""
    ext = _load()[0]
    m = _NO_MASK if mask is None else mask[:, 0]
    return ext.row_attention(q, k_cache, v_cache, rows, start, span, m, q.shape[-1] ** -0.5)
