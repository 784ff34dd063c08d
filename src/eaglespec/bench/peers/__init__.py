"""Out-of-process peers for `eaglespec bench` (llama.cpp). Optional: nothing here is needed by the default run."""
