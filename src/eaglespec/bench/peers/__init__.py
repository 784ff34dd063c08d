"""Peers for `eaglespec bench`: transformers' generate in process, llama.cpp out of process (optional: nothing
there is needed by the default run), and external checks of exported drafters (interop.py)."""
