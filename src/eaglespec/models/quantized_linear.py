"""QuantizedLinear: a decoder linear whose weight is held as int8 or int4 codes (with bf16 scales), and
FusedQuantized, one matmul over several of them. The layouts:

  int8  weight-only, symmetric, one scale per output channel; activations rounded to bf16 (W8A16)
  int4  weight-only, asymmetric, a scale and a zero point per group of `group` input channels (W4A16)
  w8a8  int8 weights as above, and each activation row rounded on the fly to int8 with its own scale
        (dynamic, per token, symmetric: what llama.cpp's q8_0 CPU dot products and vLLM's W8A8-int8
        schemes compute); the int8 x int8 products are summed exactly in int32

Kernels, measured in BENCHMARKS.md, Quantized targets (`scripts/bench/quant_kernels.py`): weight-only layers run torch's
`_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` on bf16 activations (with fp32 activations they are
4-20x slower than dense fp32; with bf16 a one-row call is several times faster than dense fp32, but the
cost grows ~linearly with rows). W8A8 runs the fastest exact int8 kernel for the weight's shape and the
call's row count (models/int8_kernels.py). Off CPU the weight is dequantized for each call (correct, not
fast).

Lossless by construction: plain steps and every verification forward of a quantized target run these
same layers, so speculative output is defined against -- and equals -- the quantized target's own.
Every kernel here is row-invariant (a row's bits do not depend on the rows beside it), and the rest of
the forward must be too, because these layers round their inputs (to bf16, or to int8 steps): a
quantized target on CPU attends with the row-invariant kernel (models/row_attention.py), or in fp64 where
that cannot be compiled (precision.attention_dtype), so each row of a verification forward equals the plain
step bit for bit (tests/test_quantize.py checks every family). Found the hard
way: with fp32 attention, casting to bf16 around the matmuls changed greedy tokens (Qwen3 test) and W8A8
changed 2 of 16 bundled prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import int8_kernels  # looked up on the module, so a test can substitute the kernel choice

BITS = (8, 4)
DEFAULT_GROUP = 128  # int4: 0.14x of fp32 bytes with scales, 0.19x at group 32 (BENCHMARKS.md, Quantized targets)
INT4_GROUPS = (32, 64, 128, 256)  # what torch's int4 CPU kernel accepts
INT4_ROWS = 16  # the int4 CPU kernel packs output channels in blocks of 16: others are zero-padded
HELD_DTYPE = torch.bfloat16  # scales and zero points are held at bf16 precision (the kernels' smallest)
ACTIVATIONS = (None, "int8")  # None: weight-only; "int8": dynamic per-token int8 activations (W8A8)


def _held(scale: torch.Tensor) -> torch.Tensor:
    """The scale as the kernel will hold it (bf16), nudged up first so that rounding never shrinks it
    (a smaller scale would push the largest weights past the last code)."""
    return (scale.clamp(min=1e-12) * (1 + 2**-8)).to(HELD_DTYPE).float()


class QuantizedLinear(nn.Module):
    """y = x @ dequant(q).T + bias, returned in x's precision. Weight-only (activations=None): on CPU x is
    rounded to bf16 for torch's kernels (W8A16 / W4A16); with activations="int8" (int8 weights only) x is
    rounded per row to int8 steps (quantize_rows) and the integer products are summed exactly.
    Buffers: `codes` (int8 [out, in]; int4: two codes per byte [out, in / 2], the even column in the low
    nibble), `scales` (bf16 [out] or [out, in / group]) and, for int4, `zeros` (bf16 [out, in / group]):
    the layout `eaglespec quantize` saves."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int = DEFAULT_GROUP,
                 bias: bool = False, device=None, activations: str | None = None):  # fmt: skip
        super().__init__()
        if bits not in BITS:
            raise ValueError(f"--quantize supports int8, int4 and w8a8, got {bits} bits")
        if activations not in ACTIVATIONS or (activations and bits != 8):
            raise ValueError(f"activation quantization {activations!r} needs int8 weights (w8a8); "
                             f"supported: {ACTIVATIONS[1:]}")  # fmt: skip
        n, k = out_features, in_features
        if bits == 4:
            if group not in INT4_GROUPS:
                raise ValueError(f"--quantize-group must be one of {', '.join(map(str, INT4_GROUPS))} "
                                 f"(the int4 kernel's group sizes), got {group}")  # fmt: skip
            if k % group:
                raise ValueError(f"int4 group size {group} does not divide the layer's {k} input channels; "
                                 f"use --quantize-group with a divisor of {k} or --quantize int8")  # fmt: skip
        self.in_features, self.out_features, self.bits, self.group = k, n, bits, group
        self.activations = activations
        kw = {"device": device}
        self.bias = nn.Parameter(torch.zeros(n, **kw), requires_grad=False) if bias else None
        if bits == 8:
            self.register_buffer("codes", torch.zeros(n, k, dtype=torch.int8, **kw))
            self.register_buffer("scales", torch.zeros(n, dtype=HELD_DTYPE, **kw))
            self.register_buffer("zeros", None)
        else:
            self.register_buffer("codes", torch.zeros(n, k // 2, dtype=torch.uint8, **kw))
            self.register_buffer("scales", torch.zeros(n, k // group, dtype=HELD_DTYPE, **kw))
            self.register_buffer("zeros", torch.zeros(n, k // group, dtype=HELD_DTYPE, **kw))
        self._kernels = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group: int = DEFAULT_GROUP,
                    activations: str | None = None) -> QuantizedLinear:  # fmt: skip
        w = linear.weight.detach().float()
        n, k = w.shape
        q = cls(k, n, bits, group, bias=linear.bias is not None, activations=activations)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        # scales (and int4 zero points) are held in bf16; codes are rounded against those held values,
        # so every weight is within half a step of what the layer computes with
        if bits == 8:
            scale = _held(w.abs().amax(1) / 127)
            q.codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            q.scales = scale.to(HELD_DTYPE)
        else:
            wg = w.view(n, k // group, group)
            low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
            scale = _held((high - low) / 15)
            zero = (low + 8 * scale).to(HELD_DTYPE).float()  # the kernel computes (code - 8) * scale + zero
            codes = (torch.round((wg - zero) / scale) + 8).clamp(0, 15).to(torch.uint8).view(n, k)
            q.codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
            q.scales = scale.view(n, -1).to(HELD_DTYPE)
            q.zeros = zero.view(n, -1).to(HELD_DTYPE)
        return q

    @classmethod
    def concat(cls, layers: list[QuantizedLinear]) -> QuantizedLinear:
        """One layer computing `layers` (same input, same scheme) side by side; their buffers become views
        into the new one's, so the codes are held once."""
        first = layers[0]
        same = {(m.in_features, m.bits, m.group, m.activations, m.bias is not None) for m in layers}
        if len(same) != 1:
            raise ValueError("only layers of one input size, scheme and bias setting can be concatenated")
        fused = cls(first.in_features, sum(m.out_features for m in layers), first.bits, first.group,
                    bias=first.bias is not None, device=first.codes.device, activations=first.activations)  # fmt: skip
        for name in ("codes", "scales", "zeros", "bias"):
            parts = [getattr(m, name) for m in layers]
            if parts[0] is None:
                continue
            whole = torch.cat([p.detach() for p in parts])
            setattr(fused, name, nn.Parameter(whole, requires_grad=False) if name == "bias" else whole)
            row = 0
            for m, p in zip(layers, parts):
                view = whole[row : row + p.shape[0]]
                setattr(m, name, nn.Parameter(view, requires_grad=False) if name == "bias" else view)
                m._kernels = {}
                row += p.shape[0]
        return fused

    def unpacked_codes(self) -> torch.Tensor:
        """[out, in] integer codes (int4: 0..15)."""
        if self.bits == 8:
            return self.codes
        low, high = self.codes & 0xF, self.codes >> 4
        return torch.stack([low, high], -1).view(self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer computes with, in fp32 (the reference for tests and other devices)."""
        if self.bits == 8:
            return self.codes.float() * self.scales.float()[:, None]
        n, k = self.out_features, self.in_features
        groups = self.unpacked_codes().float().view(n, k // self.group, self.group) - 8
        return (groups * self.scales.float()[..., None] + self.zeros.float()[..., None]).view(n, k)

    def weight_bytes(self) -> int:
        """Bytes of codes, scales and zero points (what a forward reads)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)

    def _cpu_kernel(self, dtype: torch.dtype, traceable: bool = False):
        """The kernel for activations of `dtype` (built once per dtype; scales converted to it); traceable:
        one torch.compile can trace (W8A8's oneDNN matmul behind a custom op; built by prepare before a
        graph is traced)."""
        traceable = traceable and self.activations == "int8"  # torch's weight-only kernels trace as they are
        kernel = self._kernels.get((dtype, traceable))
        if kernel is None:
            if self.activations == "int8":
                one, many = int8_kernels.fastest_int8_kernels((self.out_features, self.in_features))
                scales = self.scales.float()
                matmuls = {name: int8_kernels.int8_matmul(name, self.codes, scales) for name in {one, many}}
                if traceable and "onednn" in matmuls:  # its packed weight is opaque to inductor
                    matmuls["onednn"] = int8_kernels.as_custom_op(matmuls["onednn"], self.out_features)

                def kernel(x):  # fp32 out: the bias is added before rounding to x's precision
                    name = one if x.shape[0] == 1 else many
                    q, scale = int8_kernels.quantize_rows(x, int8_kernels.ROW_FORMAT[name])
                    return matmuls[name](q) * scale
            elif self.bits == 8:
                codes, scales = _aligned(self.codes), self.scales.to(dtype)
                kernel = lambda x: torch._weight_int8pack_mm(x, codes, scales)  # noqa: E731
            else:
                n, pad = self.out_features, -self.out_features % INT4_ROWS
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    F.pad(self.unpacked_codes().to(torch.int32), (0, 0, 0, pad)), 1)  # fmt: skip
                sz = torch.stack([self.scales.float(), self.zeros.float()], -1)
                sz = F.pad(sz, (0, 0, 0, 0, 0, pad), value=1.0).transpose(0, 1).contiguous().to(dtype)
                group = self.group
                run = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)  # noqa: E731
                kernel = run if pad == 0 else (lambda x: run(x)[:, :n])
            self._kernels[(dtype, traceable)] = kernel
        return kernel

    def _compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # weight-only: bf16 activations (W8A16 / W4A16), where torch's kernels are fast; W8A8 rounds the
        # activations as they come to int8 steps
        return dtype if self.activations else torch.bfloat16

    def prepare(self, dtype: torch.dtype, traceable: bool = False) -> None:
        """Build now the CPU kernel a forward on `dtype` activations will use (kernel choice, packing),
        so the first request does not pay for it (models/fast_linear.prepare_for_inference calls it);
        traceable: the one a compiled graph will use (models/compiled.py)."""
        if self.codes.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            self._cpu_kernel(self._compute_dtype(dtype), traceable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            compute = self._compute_dtype(x.dtype)
            y = self._cpu_kernel(compute, torch.compiler.is_compiling())(flat.to(compute))
        elif self.activations == "int8":  # other devices: the same arithmetic, dequantized (correct, not fast)
            q, scale = int8_kernels.quantize_rows(flat)
            y = F.linear(q.float() - 128, self.codes.float()) * self.scales.float() * scale
        else:
            y = F.linear(flat, self.dequantized_weight().to(device=x.device, dtype=x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.bits == 4 else ""
        acts = ", activations=int8 per row" if self.activations else ""
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}{group}{acts}"


class FusedQuantized:
    """One quantized matmul for layers that read the same input (q/k/v, gate/up): a plain object, not a
    submodule, so state_dict and weight counts see the original layers only (models/fast_linear.py)."""

    def __init__(self, layers: list[QuantizedLinear]):
        self.layer = QuantizedLinear.concat(layers)

    @property
    def codes(self) -> torch.Tensor:
        return self.layer.codes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


ALIGN = 64  # bytes; torch's bf16 int8 kernel segfaults on codes at other offsets (seen: 40, from safetensors)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def hold_scales(model: nn.Module) -> None:
    """After loading and model.to(dtype): keep scales and zero points at the precision they were saved
    in, and codes at aligned addresses (a safetensors file places tensors at any offset)."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.codes = _aligned(m.codes)
            m.scales = m.scales.to(HELD_DTYPE)
            if m.zeros is not None:
                m.zeros = m.zeros.to(HELD_DTYPE)
            m._kernels = {}
