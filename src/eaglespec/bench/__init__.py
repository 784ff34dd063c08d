"""`eaglespec bench`: prompt suites, methods measured side by side, lossless check, sweeps, auto-tuning."""
