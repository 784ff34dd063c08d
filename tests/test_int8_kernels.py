"""The exact int8 kernels of W8A8 layers (models/int8_kernels.py): every exact kernel gives the same bits,
the kernel choice is cached per machine, and compiled graphs call oneDNN's kernel through a custom op."""

from __future__ import annotations

import pytest
import torch

from eaglespec.models.quantized_linear import QuantizedLinear
from test_quantize import _linear


def test_every_exact_int8_kernel_gives_the_same_bits():
    """The W8A8 layer picks the fastest exact kernel per weight shape: the choice must not change outputs.
    The chunked fp32 kernel is exact on any CPU, so w8a8 works everywhere."""
    from eaglespec.models.int8_kernels import EXACT_FP32_K, ROW_FORMAT, as_format, exact_int8_kernels, int8_matmul

    names = exact_int8_kernels()
    assert "fp32" in names
    g = torch.Generator().manual_seed(3)
    for k in (256, EXACT_FP32_K * 2 + 64):
        codes = torch.randint(-127, 128, (72, k), generator=g, dtype=torch.int8)
        scales = torch.rand(72, generator=g) * 0.01
        q_u8 = torch.randint(1, 256, (17, k), generator=g, dtype=torch.uint8)
        want = ((q_u8.double() - 128) @ codes.double().T).float() * scales
        for name in names:
            rows = as_format(q_u8.float() - 128, ROW_FORMAT[name])
            assert torch.equal(int8_matmul(name, codes, scales)(rows), want), (name, k)


def test_int8_kernel_choice_is_cached_per_machine_and_survives_a_corrupt_cache(tmp_path, monkeypatch):
    import json

    from eaglespec.models import int8_kernels

    monkeypatch.setenv("EAGLESPEC_CACHE_DIR", str(tmp_path))
    path = tmp_path / "int8_kernels.json"
    path.write_text("{not json")  # corrupt: measured again and rewritten
    int8_kernels.fastest_int8_kernels.cache_clear()
    chosen = int8_kernels.fastest_int8_kernels((48, 64))
    names = int8_kernels.exact_int8_kernels()
    assert all(c in names for c in chosen)
    if len(names) > 1:  # one exact kernel needs no timing and no cache
        (entry,) = json.loads(path.read_text()).items()
        assert entry[0].endswith("|48x64") and tuple(entry[1]) == chosen
        path.write_text(json.dumps({entry[0]: ["fp32", "fp32"]}))  # a cached choice is used as it is
        int8_kernels.fastest_int8_kernels.cache_clear()
        assert int8_kernels.fastest_int8_kernels((48, 64)) == ("fp32", "fp32")
    int8_kernels.fastest_int8_kernels.cache_clear()


def test_compiled_graphs_call_onednn_through_a_custom_op_with_the_same_bits(monkeypatch):
    """inductor cannot trace oneDNN's packed weight: a compiled graph calls it as eaglespec::int8_matmul,
    which gives the eager kernel's bits and lets the weight go with its layer."""
    import gc

    from eaglespec.models import int8_kernels

    if "onednn" not in int8_kernels.exact_int8_kernels():
        pytest.skip("oneDNN's int8 kernel is not exact on this CPU (no VNNI/AMX): compiled graphs never use it")
    monkeypatch.setattr(int8_kernels, "fastest_int8_kernels", lambda shape: ("onednn", "onednn"))
    layer = QuantizedLinear.from_linear(_linear(48, 64), 8, activations="int8")
    x = torch.randn(3, 64)
    want = layer(x)
    layer.prepare(torch.float32, traceable=True)
    kernel = layer._kernels[(torch.float32, True)]
    assert torch.equal(kernel(x), want)
    index = len(int8_kernels._OPAQUE) - 1
    assert torch.equal(torch.ops.eaglespec.int8_matmul(int8_kernels.quantize_rows(x)[0], index) *
                       int8_kernels.quantize_rows(x)[1], want)  # fmt: skip
    del layer, kernel
    gc.collect()
    assert int8_kernels._OPAQUE[index][0]() is None
