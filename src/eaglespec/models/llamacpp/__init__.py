"""llama.cpp runtimes through its C API (ctypes): a GGUF target run by llama.cpp's kernels, exact by construction
(see cache.py), and the drafter's layer in llama.cpp's EAGLE-3 graph (drafter.py). Needs scripts/llamacpp/build.sh."""
