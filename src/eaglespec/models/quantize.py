"""Quantization of a target's decoder linears at load time. Schemes (`--quantize`):

  int8  weight-only, symmetric, one scale per output channel; activations rounded to bf16 (W8A16)
  int4  weight-only, asymmetric, a scale and a zero point per group of `group` input channels (W4A16)
  w8a8  int8 weights as above, and each activation row rounded on the fly to int8 with its own scale
        (dynamic, per token, symmetric: what llama.cpp's q8_0 CPU dot products and vLLM's W8A8-int8
        schemes compute); the int8 x int8 products are summed exactly in int32

Kernels, measured in BENCHMARKS.md §12 (`scripts/bench/quant_kernels.py`): weight-only layers run torch's
`_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` on bf16 activations (with fp32 activations they are
4-20x slower than dense fp32; with bf16 a one-row call is several times faster than dense fp32, but the
cost grows ~linearly with rows). W8A8 runs the fastest exact int8 kernel for the weight's shape and
the call's row count (one row, or more) here
(oneDNN's prepacked u8s8 linear, torch._int_mm, or a chunked fp32 GEMM that is exact on any CPU:
`_exact_int8_kernels` checks exactness with extreme codes, since CPUs without VNNI/AMX saturate pairs of
u8 x s8 products in int16); its cost stays nearly flat from 1 to 17 rows. Compiled graphs
(models/compiled.py) call the oneDNN kernel through the `eaglespec::int8_matmul` custom op, since inductor
cannot trace its packed weight. Off CPU the weight is dequantized for each call (correct, not fast).

Lossless by construction: plain steps and every verification forward of a quantized target run these
same layers, so speculative output is defined against -- and equals -- the quantized target's own.
Every kernel here is row-invariant (a row's bits do not depend on the rows beside it), and the rest of
the forward must be too, because these layers round their inputs (to bf16, or to int8 steps): a
quantized target attends in fp64 on CPU (precision.attention_dtype), so each row of a verification forward
equals the plain step bit for bit (tests/test_quantize.py checks every family). Found the hard way:
with fp32 attention, casting to bf16 around the matmuls changed greedy tokens (Qwen3 test) and W8A8
changed 2 of 16 bundled prompts.
"""

from __future__ import annotations

import functools
import json
import shutil
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

BITS = (8, 4)
DEFAULT_GROUP = 128  # int4: 0.14x of fp32's bytes with scales, against 0.19x at group 32 (BENCHMARKS §12)
INT4_GROUPS = (32, 64, 128, 256)  # what torch's int4 CPU kernel accepts
INT4_ROWS = 16  # the int4 CPU kernel packs output channels in blocks of 16: others are zero-padded
HELD_DTYPE = torch.bfloat16  # scales and zero points are held at bf16 precision (the kernels' smallest)
ACTIVATIONS = (None, "int8")  # None: weight-only; "int8": dynamic per-token int8 activations (W8A8)
SCHEMES = {"int8": (8, None), "int4": (4, None), "w8a8": (8, "int8")}  # --quantize name -> (bits, activations)


def _held(scale: torch.Tensor) -> torch.Tensor:
    """The scale as the kernel will hold it (bf16), nudged up first so that rounding never shrinks it
    (a smaller scale would push the largest weights past the last code)."""
    return (scale.clamp(min=1e-12) * (1 + 2**-8)).to(HELD_DTYPE).float()


# int8 x int8 -> exact sums on CPU: oneDNN's prepacked u8s8 linear and torch._int_mm (exact where the CPU
# has VNNI/AMX), and an fp32 GEMM over chunks of EXACT_FP32_K input channels, exact on any CPU (every
# partial sum is an integer below 2**24), at dense fp32 speed and with an fp32 copy of the codes
INT8_KERNELS = ("onednn", "int_mm", "fp32")
EXACT_FP32_K = 1024  # 1024 * 127 * 127 < 2**24
INT8_KERNEL_CACHE = "int8_kernels.json"  # in machine.cache_dir()
STREAMED_BYTES = 64 * 2**20  # kernel timing streams at least this much weight (beyond a CPU's last-level cache)


def _int8_matmul(name: str, codes: torch.Tensor, scales: torch.Tensor):
    """Rows rounded by quantize_rows in this kernel's ROW_FORMAT -> fp32 [m, n] = float(rows @ codes.T,
    summed exactly) * scales: every kernel gives the same bits."""
    if name == "onednn":
        packed = torch.ops.onednn.qlinear_prepack(codes, None)
        zero = torch.zeros(codes.shape[0], dtype=torch.int64)
        return lambda q: torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 128, packed, scales, zero, None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip
    if name == "int_mm":
        codes_t = codes.t()
        return lambda q: torch._int_mm(q, codes_t).float() * scales
    chunks = [(i, codes[:, i : i + EXACT_FP32_K].float()) for i in range(0, codes.shape[1], EXACT_FP32_K)]
    if len(chunks) == 1:
        return lambda q: F.linear(q, chunks[0][1]) * scales

    def chunked(q):
        acc = sum(F.linear(q[:, i : i + EXACT_FP32_K], w).to(torch.int32) for i, w in chunks)
        return acc.float() * scales

    return chunked


ROW_FORMAT = {"onednn": "u8", "int_mm": "s8", "fp32": "f32"}  # how each kernel takes the rounded rows

# oneDNN matmuls of compiled W8A8 layers, called from the graphs through one custom op (inductor cannot
# trace the packed weight, and compiling failed with it inlined): weak, so a dropped model frees them
_OPAQUE: list[tuple[weakref.ref, int]] = []


@torch.library.custom_op("eaglespec::int8_matmul", mutates_args=())
def _opaque_int8_matmul(rows: torch.Tensor, index: int) -> torch.Tensor:
    return _OPAQUE[index][0]()(rows)


@_opaque_int8_matmul.register_fake
def _(rows: torch.Tensor, index: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], _OPAQUE[index][1]), dtype=torch.float32)


def _opaque(run, out_features: int):
    """`run` ([m, in] rounded rows -> fp32 [m, out]) as a call torch.compile keeps as it is."""
    _OPAQUE.append((weakref.ref(run), out_features))
    index = len(_OPAQUE) - 1

    def opaque(rows):
        return _opaque_int8_matmul(rows, index)

    opaque.run = run  # the weak reference's target lives as long as the layer's kernel
    return opaque


def _as_format(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Float codes in [-127, 127] -> "u8" (codes + 128, uint8: oneDNN), "s8" (int8: int_mm) or "f32".
    Consumes `codes` (offset in place: a fresh tensor from every caller, no extra copy per call)."""
    if fmt == "u8":
        return codes.add_(128).to(torch.uint8)
    return codes.to(torch.int8) if fmt == "s8" else codes



@functools.cache
def _exact_int8_kernels() -> tuple[str, ...]:
    """The int8 kernels whose sums are exact here at 1, 5 and 17 rows (so they agree bit for bit), tried
    with the largest codes (where CPUs without VNNI/AMX saturate pairs of u8 x s8 products in int16) and
    more input channels than one fp32 chunk."""
    g = torch.Generator().manual_seed(0)
    k, n = EXACT_FP32_K + 256, 48
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[:, :64] = 127
    x = torch.randint(-127, 128, (17, k), generator=g, dtype=torch.int8)
    x[:, :64] = 127
    x[1::2, :64] = -127
    scales = torch.rand(n, generator=g) * 0.01
    exact = (x.double() @ w.double().T).float() * scales  # as float(int32 sum) * scale
    found = []
    for name in INT8_KERNELS:
        try:
            run, rows = _int8_matmul(name, w, scales), _as_format(x.float(), ROW_FORMAT[name])
            checks = [(rows[:m], exact[:m]) for m in (1, 5, 17)] + [(rows[3:4], exact[3:4])]
            if all(torch.equal(run(r), want) for r, want in checks):
                found.append(name)
        except (RuntimeError, AttributeError):
            continue
    return tuple(found)


@functools.cache
def _fastest_int8_kernels(shape: tuple[int, int]) -> tuple[str, str]:
    """Of the exact kernels, the fastest here for an [out, in] weight for one-row calls (plain steps) and
    for 4- and 17-row calls (verification). They give the same bits, so a layer may use one for plain
    steps and another for verification. Measured on a 2-vCPU EPYC: int_mm wins one-row calls on most
    weights, oneDNN many-row calls and the largest weights (BENCHMARKS §12)."""
    from ..machine import best_seconds, cpu_name, read_cached, write_cached

    names = _exact_int8_kernels() or ("fp32",)
    if len(names) < 2:
        return names[0], names[0]
    # cached on disk per machine: timing a 365M model's four shapes takes seconds at every start
    key = f"{cpu_name()}|{torch.get_num_threads()}|{torch.__version__}|{','.join(names)}|{shape[0]}x{shape[1]}"
    hit = read_cached(INT8_KERNEL_CACHE).get(key)
    if isinstance(hit, list) and len(hit) == 2 and all(h in names for h in hit):
        return hit[0], hit[1]
    g = torch.Generator().manual_seed(0)
    # distinct copies of the weight, as a model's layers are, so a large weight streams from memory as
    # it does in decoding (one copy would be timed from cache and favour the wrong kernel)
    copies = max(1, min(24, -(-STREAMED_BYTES // (shape[0] * shape[1]))))
    ws = [torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(copies)]
    xs = [torch.randint(-127, 128, (m, shape[1]), generator=g).float() for m in (1, 4, 17)]
    one, many = {}, {}
    for name in names:
        runs = [_int8_matmul(name, w, torch.ones(shape[0])) for w in ws]
        rows = [_as_format(x.clone(), ROW_FORMAT[name]) for x in xs]
        one[name] = best_seconds(lambda runs=runs, r=rows[0]: [run(r) for run in runs], 5)
        many[name] = best_seconds(lambda runs=runs, rows=rows[1:]: [run(r) for run in runs for r in rows], 5)
    chosen = (min(one, key=one.get), min(many, key=many.get))
    write_cached(INT8_KERNEL_CACHE, key, list(chosen))
    return chosen


def quantize_rows(x: torch.Tensor, fmt: str = "u8") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric int8: (codes [m, k], scale fp32 [m, 1]) with x ~ codes * scale, codes in
    [-127, 127] = round(x * 127 / amax) (vLLM's scaled_int8_quant rounds the same way), returned as
    fmt "u8" (codes + 128, uint8), "s8" (int8) or "f32" (float). Each row's codes depend on that row only."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp_(min=1e-30)
    return _as_format(torch.round(xf * (127 / amax)), fmt), amax / 127


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
                one, many = _fastest_int8_kernels((self.out_features, self.in_features))
                scales = self.scales.float()
                matmuls = {name: _int8_matmul(name, self.codes, scales) for name in {one, many}}
                if traceable and "onednn" in matmuls:  # its packed weight is opaque to inductor
                    matmuls["onednn"] = _opaque(matmuls["onednn"], self.out_features)

                def kernel(x):  # fp32 out: the bias is added before rounding to x's precision
                    name = one if x.shape[0] == 1 else many
                    q, scale = quantize_rows(x, ROW_FORMAT[name])
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
            q, scale = quantize_rows(flat)
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


def parse_quantize(text: str | None) -> tuple[int, str | None] | None:
    """'int8' / 'int4' / 'w8a8' -> (weight bits, activations); None or 'none' -> None."""
    if text in (None, "none"):
        return None
    scheme = SCHEMES.get(text)
    if scheme is None:
        raise ValueError(f"--quantize must be one of {', '.join(SCHEMES)} or none, got {text!r}")
    return scheme


def quantization_info(bits: int, group: int, activations: str | None) -> dict:
    """What `model.quantization` holds (and reports) for a scheme."""
    return {"bits": bits, "group": group if bits == 4 else None, "activations": activations}


def quantize_target(target: nn.Module, bits: int, group: int = DEFAULT_GROUP,
                    activations: str | None = None) -> nn.Module:  # fmt: skip
    """Replace the linear layers of every decoder layer (attention and MLP) by QuantizedLinear, in
    place. Embeddings and lm_head stay in the loaded precision (the drafter shares the embedding)."""
    if group < 1:
        raise ValueError(f"--quantize-group must be >= 1, got {group}")
    if getattr(target, "quantization", None) is not None:
        raise ValueError("this target is already quantized (a saved `eaglespec quantize` directory): "
                         "load it without --quantize")  # fmt: skip
    _replace_decoder_linears(target, lambda linear: QuantizedLinear.from_linear(linear, bits, group, activations))
    target.quantization = quantization_info(bits, group, activations)
    return target


def apply_quantize(target: nn.Module, name: str | None, group: int | None = None) -> nn.Module:
    """`--quantize NAME [--quantize-group G]` on a loaded target (no-op for None / 'none')."""
    scheme = parse_quantize(name)
    if scheme is not None:
        quantize_target(target, scheme[0], DEFAULT_GROUP if group is None else group, scheme[1])
    return target


def scheme_name(quantization: dict) -> str:
    """'int8', 'w8a8' or 'int4 g128' for a model's `quantization`."""
    if quantization.get("activations"):
        return "w8a8"
    return f"int{quantization['bits']}" + (f" g{quantization['group']}" if quantization["bits"] == 4 else "")


def _replace_decoder_linears(model: nn.Module, make) -> None:
    """Every nn.Linear of the decoder layers' attention and MLP -> make(linear), in place; matmuls fused
    from them earlier (models/fast_linear.py) read the old weights and are dropped."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child))
            for fused in ("_qkv", "_gate_up"):
                if hasattr(parent, fused):
                    delattr(parent, fused)


# -- saved quantized targets ---------------------------------------------------------------------------
QUANT_METHOD = "eaglespec"  # quantization_config.quant_method of directories written by `eaglespec quantize`
WEIGHT_FILES = (".safetensors", ".bin")
NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def save_quantized(target: nn.Module, source_dir, out_dir) -> Path:
    """Write a quantized target as an HF-style directory that loads without re-quantizing: config.json
    with a `quantization_config`, model.safetensors (codes/scales/zeros per quantized layer, the other
    tensors as loaded), and the source's tokenizer and generation files."""
    from .io import save_tensors, write_json

    q = getattr(target, "quantization", None)
    if q is None:
        raise ValueError("the target is not quantized: call quantize_target first")
    source, out = Path(source_dir), Path(out_dir)
    if out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the source directory; choose another folder")
    from .io import parse_dtype

    config = json.loads((source / "config.json").read_text())
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("rotary.")}
    if target.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, saved once
    held = {id(t) for m in target.modules() if isinstance(m, QuantizedLinear) for t in (m.scales, m.zeros)}
    state = {k: v.to(parse_dtype(stored)) if v.is_floating_point() and id(v) not in held else v
             for k, v in state.items()}  # unquantized tensors in the source's precision  # fmt: skip
    save_tensors(state, out)
    for f in source.iterdir():
        if f.is_file() and f.suffix not in WEIGHT_FILES and f.name not in NOT_COPIED:
            shutil.copyfile(f, out / f.name)
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "bits": q["bits"], "group_size": q["group"],
                                     "activations": q.get("activations"),
                                     "modules": "decoder layers: self_attn and mlp linears"}  # fmt: skip
    write_json(config, out / "config.json")
    return out


def quantized_shells(model: nn.Module, qcfg: dict, where: str) -> None:
    """Before loading a saved quantized target: replace the decoder layers' linears of a (meta) model
    by empty QuantizedLinear of the saved layout, so the checkpoint's tensors are checked against it."""
    from .io import CheckpointError

    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != QUANT_METHOD:
        method = qcfg.get("quant_method") if isinstance(qcfg, dict) else qcfg
        raise CheckpointError(f"{where}: quantization_config.quant_method {method!r} is not supported; eaglespec "
                              f"reads the layout `eaglespec quantize` writes ({QUANT_METHOD!r}) and "
                              "compressed-tensors (models/compressed.py), or quantizes an unquantized model at "
                              "load with --quantize")  # fmt: skip
    bits, group = qcfg.get("bits"), qcfg.get("group_size") or DEFAULT_GROUP
    activations = qcfg.get("activations")
    try:
        _replace_decoder_linears(model, lambda linear: QuantizedLinear(
            linear.in_features, linear.out_features, bits, group, bias=linear.bias is not None, device="meta",
            activations=activations))  # fmt: skip
    except ValueError as e:
        raise CheckpointError(f"{where}: bad quantization_config ({e})") from None
    model.quantization = quantization_info(bits, group, activations)


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
