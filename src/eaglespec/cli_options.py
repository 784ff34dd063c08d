"""Command-line options shared by several commands (generate, serve, bench, data, train). No dependencies,
so every command's parser may import it without loading torch."""

from __future__ import annotations

QUANTIZE_CHOICES = ("none", "int8", "int4", "w8a8")  # models/quantize.py SCHEMES, plus none


def add_quantize_args(p, effect: str, default: str | None = "none") -> None:
    """--quantize and --quantize-group; `effect` says what quantizing the target means for this command."""
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=default,
                   help="quantize the target's decoder layers at load (models/quantize.py; README: Quantized "
                        f"targets): int8/int4 weight-only, w8a8 int8 weights and per-token int8 activations; {effect}")
    p.add_argument("--quantize-group", type=int, default=None, help="int4: input channels per scale (default 128)")
