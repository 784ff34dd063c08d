"""The llama.cpp target runtime: a GGUF target run by llama.cpp's kernels through its C API (ctypes), with our
drafter, trees and verification; exact by construction (see cache.py). Needs scripts/llamacpp/build.sh."""
