"""eaglespec: EAGLE-3 / EAGLE-3.1 speculative decoding."""

__version__ = "0.1.0"
