"""`eaglespec bench`: methods measured side by side on the prompt suites, lossless check, sweeps, auto-tuning."""
