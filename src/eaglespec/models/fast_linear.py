"""Inference-time linear layers: fewer, faster matmuls, and the same result for every row count.

`prepare_for_inference(model)` (called by the Engine once per model):
1. fuses the q/k/v projections and the gate/up projections of every layer into one matmul each (the
   original Linear modules keep their parameters, as views into the fused weight: no second copy);
2. on CPU, holds every matmul's weight in oneDNN's pre-packed layout and runs it with oneDNN's
   linear kernel. Measured on a 2-vCPU EPYC (BENCHMARKS.md, fast path): the 33 matmuls of one step
   of the bundled target take 2.7 ms instead of 5.2 (fp32, one token) and 3.4 instead of 10.4
   (17 tokens); bf16 1.5 / 2.4 ms instead of 3.3 / 5.0. And oneDNN's results for a row do not depend
   on how many rows are in the call, while MKL's fp32 GEMM changes the summation order with M, so
   plain decoding (1 token) and tree verification (17) give bit-identical logits. That property is
   checked on this machine before packing is used (`_row_invariant`); if it fails, or oneDNN is
   missing, the plain `torch.nn.functional.linear` path stays. bf16 packing is also timed against
   F.linear per weight shape (`_packing_pays`) and kept only where faster; fp32 is always packed, since
   exact speculation needs every fp32 linear row-invariant (on a 2-vCPU Xeon with AMX fp32 oneDNN adds
   ~10 us per call at one row: bundled target, one-token step 3.1 ms all packed vs 2.6 ms). F.linear's
   rows differ by ~1e-6 between row counts in fp32 (models/precision.py checks the forward's gap at load).

Packed weights are a second copy of the linear weights (the originals stay for state_dict, tied
embeddings and the quantizer), so resident memory for those grows 2x on CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..machine import best_seconds
from .layers import MLP, Attention
from .quantized_linear import FusedQuantized, QuantizedLinear

_PACKABLE = (torch.float32, torch.bfloat16)


@functools.cache
def _row_invariant(dtype: torch.dtype) -> bool:
    """Does oneDNN's packed linear give each row the same bits at 1, 5 and 17 rows here?"""
    try:
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(384, 256, generator=g) * 0.05).to(dtype)
        x = torch.randn(17, 256, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        run = lambda v: torch.ops.mkldnn._linear_pointwise(v, packed, None, "none", [], "")
        full = run(x)
        close = torch.allclose(full.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=0.02)
        return close and all(torch.equal(run(x[:m]), full[:m]) for m in (1, 5)) and torch.equal(run(x[3:4]), full[3:4])
    except (RuntimeError, AttributeError):
        return False


def packing_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE
        and torch.backends.mkldnn.is_available()
        and _row_invariant(weight.dtype)
        # fp32: always, since exact speculation needs every linear row-invariant (models/row_attention.py)
        and (weight.dtype == torch.float32 or _packing_pays(tuple(weight.shape), weight.dtype))
    )


TIMED_ROWS = (1, 17)  # a plain step and a 16-node tree verification


@functools.cache
def _packing_pays(shape: tuple[int, int], dtype: torch.dtype, reps: int = 15) -> bool:
    """Is oneDNN's packed linear at most as slow as F.linear for this weight shape here (one-row plus
    17-row call, best of `reps`)? Measured once per shape and dtype in a process (milliseconds)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(*shape, generator=g) * 0.05).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    xs = [torch.randn(m, shape[1], generator=g).to(dtype) for m in TIMED_ROWS]
    packed_s = best_seconds(lambda: [torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "") for x in xs],
                            reps)  # fmt: skip
    return packed_s <= best_seconds(lambda: [F.linear(x, w) for x in xs], reps)


class FastLinear:
    """y = x @ weight.T + bias with a oneDNN-packed weight on CPU (else F.linear). Holds no gradient."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight.detach(), (bias.detach() if bias is not None else None)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None) if packing_available(weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != self.weight.dtype or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)  # compiled graphs: inductor picks the GEMM
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*lead, y.shape[-1])


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear at inference: shares its parameters (state_dict and weight ties are
    unchanged) and computes through FastLinear."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.fast = FastLinear(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fast(x)


def _fuse(linears: list[nn.Linear]) -> FastLinear | FusedQuantized | None:
    """One matmul for linears that read the same input; each linear's parameters become views into
    the concatenated weight, so there is one copy in memory."""
    if all(isinstance(m, QuantizedLinear) for m in linears):
        return FusedQuantized(linears)  # also quantizes a W8A8 layer's input once instead of 2-3 times
    if not all(type(m) in (nn.Linear, PackedLinear) for m in linears) or len({m.weight.dtype for m in linears}) != 1:
        return None
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        return None
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return FastLinear(weight, bias)


def _stale(fused: FastLinear | FusedQuantized | None, first: nn.Module) -> bool:
    """Weights moved (model.to) or replaced since the last preparation."""
    if isinstance(fused, FusedQuantized):
        return not isinstance(first, QuantizedLinear) or fused.codes.data_ptr() != first.codes.data_ptr()
    return fused is None or not hasattr(first, "weight") or fused.weight.data_ptr() != first.weight.data_ptr()


def prepare_for_inference(model: nn.Module, traceable: bool = False) -> nn.Module:
    """Fuse and pack the model's linear layers (see the module docstring). Idempotent; call it again
    after moving the model to another device or dtype. traceable: also build the quantized kernels
    torch.compile can trace (models/compiled.py calls it so)."""
    fused_members = set()
    for m in list(model.modules()):
        if isinstance(m, Attention):
            if _stale(getattr(m, "_qkv", None), m.q_proj):
                m._qkv = _fuse([m.q_proj, m.k_proj, m.v_proj])
            if m._qkv is not None:
                fused_members |= {id(m.q_proj), id(m.k_proj), id(m.v_proj)}
        elif isinstance(m, MLP):
            if _stale(getattr(m, "_gate_up", None), m.gate_proj):
                m._gate_up = _fuse([m.gate_proj, m.up_proj])
            if m._gate_up is not None:
                fused_members |= {id(m.gate_proj), id(m.up_proj)}
    dtype = next(model.parameters()).dtype  # the activations' precision
    for m in list(model.modules()):
        for fused in (getattr(m, "_qkv", None), getattr(m, "_gate_up", None)):
            if isinstance(fused, FusedQuantized):
                fused.layer.prepare(dtype, traceable)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in fused_members:
                continue  # computed by the fused matmul; no packed copy needed
            if isinstance(child, QuantizedLinear):
                child.prepare(dtype, traceable)
            if type(child) is nn.Linear and packing_available(child.weight):
                setattr(parent, name, PackedLinear(child))
            elif isinstance(child, PackedLinear) and child.fast.weight.data_ptr() != child.weight.data_ptr():
                child.fast = FastLinear(child.weight, child.bias)  # moved since it was packed
    return model


def kernel_signature(model: nn.Module) -> str:
    """Which fused or wrapped matmuls run packed (P) or through F.linear (F), in module order (linears
    left unwrapped always run F.linear): step costs measured with one choice do not hold for another
    (speculation/costs.py keys its cache by this)."""
    marks = []
    for m in model.modules():
        fast = [getattr(m, "_qkv", None), getattr(m, "_gate_up", None), getattr(m, "fast", None)]
        marks += ["P" if f.packed is not None else "F" for f in fast if isinstance(f, FastLinear)]
        marks += ["Q" for f in fast if isinstance(f, FusedQuantized)]
    return "".join(marks)
