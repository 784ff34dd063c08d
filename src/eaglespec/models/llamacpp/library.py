"""ctypes declarations of the llama.cpp C API functions the target and drafter runtimes call.

They mirror include/llama.h and src/llama-ext.h of the version scripts/llamacpp/build.sh builds (the
llama-cpp-python 0.3.36 sdist's vendored llama.cpp); the structs are passed by value, so their fields
must match that version exactly. The library is $EAGLESPEC_LLAMACPP/build/bin/libllama.so
(default ~/.cache/eaglespec/llama.cpp), loaded once per process.
"""

from __future__ import annotations

import ctypes as C
import os
from functools import cache
from pathlib import Path

BUILD_HINT = "run scripts/llamacpp/build.sh (builds llama.cpp once, ~20 min on 2 cores)"

token_t = pos_t = seq_t = C.c_int32
GGML_TYPE = {"f32": 0, "f16": 1, "q8_0": 8}
FLASH_ATTN_ENABLED = 1


def llamacpp_root() -> Path:
    env = os.environ.get("EAGLESPEC_LLAMACPP")
    return Path(env) if env else Path.home() / ".cache" / "eaglespec" / "llama.cpp"


def library_path(root: Path | None = None) -> Path:
    return (root or llamacpp_root()) / "build" / "bin" / "libllama.so"


def missing_reason(root: Path | None = None) -> str | None:
    """Why the runtime cannot load (None when it can)."""
    path = library_path(root)
    return None if path.is_file() else f"llama.cpp's shared library is not built ({path} is missing); {BUILD_HINT}"


class Batch(C.Structure):
    _fields_ = [("n_tokens", C.c_int32), ("token", C.POINTER(token_t)), ("embd", C.POINTER(C.c_float)),
                ("pos", C.POINTER(pos_t)), ("n_seq_id", C.POINTER(C.c_int32)),
                ("seq_id", C.POINTER(C.POINTER(seq_t))), ("logits", C.POINTER(C.c_int8))]  # fmt: skip


class ModelParams(C.Structure):
    _fields_ = [("devices", C.c_void_p), ("tensor_buft_overrides", C.c_void_p), ("n_gpu_layers", C.c_int32),
                ("split_mode", C.c_int), ("load_mode", C.c_int), ("lazy_mode", C.c_int), ("main_gpu", C.c_int32),
                ("tensor_split", C.c_void_p), ("progress_callback", C.c_void_p),
                ("progress_callback_user_data", C.c_void_p), ("kv_overrides", C.c_void_p),
                ("vocab_only", C.c_bool), ("check_tensors", C.c_bool), ("use_extra_bufts", C.c_bool),
                ("no_host", C.c_bool), ("no_alloc", C.c_bool), ("load_mtp", C.c_bool)]  # fmt: skip


class ContextParams(C.Structure):
    _fields_ = [("n_ctx", C.c_uint32), ("n_batch", C.c_uint32), ("n_ubatch", C.c_uint32), ("n_seq_max", C.c_uint32),
                ("n_rs_seq", C.c_uint32), ("n_outputs_max", C.c_uint32), ("n_outputs_max_per_seq", C.c_uint32),
                ("n_threads", C.c_int32), ("n_threads_batch", C.c_int32), ("ctx_type", C.c_int),
                ("rope_scaling_type", C.c_int), ("pooling_type", C.c_int), ("attention_type", C.c_int),
                ("flash_attn_type", C.c_int), ("rope_freq_base", C.c_float), ("rope_freq_scale", C.c_float),
                ("yarn_ext_factor", C.c_float), ("yarn_attn_factor", C.c_float), ("yarn_beta_fast", C.c_float),
                ("yarn_beta_slow", C.c_float), ("yarn_orig_ctx", C.c_uint32), ("defrag_thold", C.c_float),
                ("cb_eval", C.c_void_p), ("cb_eval_user_data", C.c_void_p), ("type_k", C.c_int), ("type_v", C.c_int),
                ("abort_callback", C.c_void_p), ("abort_callback_data", C.c_void_p), ("embeddings", C.c_bool),
                ("offload_kqv", C.c_bool), ("no_perf", C.c_bool), ("op_offload", C.c_bool), ("swa_full", C.c_bool),
                ("kv_unified", C.c_bool), ("samplers", C.c_void_p), ("n_samplers", C.c_size_t),
                ("ctx_other", C.c_void_p)]  # fmt: skip


class Embd(C.Structure):  # llama_embd: a non-owning view of embedding rows
    _fields_ = [("data", C.POINTER(C.c_float)), ("n_rows", C.c_size_t), ("n_embd", C.c_size_t)]


PROCESS_DECODE = 1  # llama_process_type


_LOG_CALLBACK = C.CFUNCTYPE(None, C.c_int, C.c_char_p, C.c_void_p)
_QUIET = _LOG_CALLBACK(lambda level, text, data: None)  # kept alive: llama.cpp holds the pointer

_SIGNATURES = {  # name: (result, argument types)
    "llama_backend_init": (None, []),
    "llama_log_set": (None, [_LOG_CALLBACK, C.c_void_p]),
    "llama_model_default_params": (ModelParams, []),
    "llama_context_default_params": (ContextParams, []),
    "llama_model_load_from_file": (C.c_void_p, [C.c_char_p, ModelParams]),
    "llama_model_free": (None, [C.c_void_p]),
    "llama_init_from_model": (C.c_void_p, [C.c_void_p, ContextParams]),
    "llama_free": (None, [C.c_void_p]),
    "llama_model_n_embd": (C.c_int32, [C.c_void_p]),
    "llama_model_n_layer": (C.c_int32, [C.c_void_p]),
    "llama_model_get_vocab": (C.c_void_p, [C.c_void_p]),
    "llama_vocab_n_tokens": (C.c_int32, [C.c_void_p]),
    "llama_batch_init": (Batch, [C.c_int32, C.c_int32, C.c_int32]),
    "llama_batch_free": (None, [Batch]),
    "llama_decode": (C.c_int32, [C.c_void_p, Batch]),
    "llama_get_logits": (C.POINTER(C.c_float), [C.c_void_p]),
    "llama_get_memory": (C.c_void_p, [C.c_void_p]),
    "llama_memory_clear": (None, [C.c_void_p, C.c_bool]),
    "llama_memory_seq_rm": (C.c_bool, [C.c_void_p, seq_t, pos_t, pos_t]),
    "llama_memory_seq_cp": (None, [C.c_void_p, seq_t, seq_t, pos_t, pos_t]),
    "llama_memory_seq_pos_max": (pos_t, [C.c_void_p, seq_t]),
    "llama_set_n_threads": (None, [C.c_void_p, C.c_int32, C.c_int32]),
    "llama_get_logits_ith": (C.POINTER(C.c_float), [C.c_void_p, C.c_int32]),
    "llama_batch_ext_init": (C.c_void_p, [C.c_void_p]),
    "llama_batch_ext_free": (None, [C.c_void_p]),
    "llama_batch_ext_clear": (None, [C.c_void_p]),
    "llama_batch_ext_add_token": (C.c_int32, [C.c_void_p, seq_t, token_t]),
    "llama_batch_ext_set_embd_token": (C.c_bool, [C.c_void_p, C.c_int32, Embd]),
    "llama_batch_ext_set_output_logits": (C.c_bool, [C.c_void_p, C.c_int32, C.c_bool]),
    "llama_batch_ext_set_pos": (C.c_bool, [C.c_void_p, C.c_int32, C.POINTER(pos_t)]),
    "llama_process": (C.c_int32, [C.c_void_p, C.c_int, C.c_void_p]),
    "llama_set_embeddings_nextn": (None, [C.c_void_p, C.c_bool, C.c_bool]),
    "llama_get_embeddings_nextn_ith": (C.POINTER(C.c_float), [C.c_void_p, C.c_int32]),
    "llama_set_embeddings_layer_inp": (None, [C.c_void_p, C.c_uint32, C.c_bool]),
    "llama_get_embeddings_layer_inp": (C.POINTER(C.c_float), [C.c_void_p, C.c_uint32]),
}


# llama-ext.h (the staging API of the layer inputs and the EAGLE-3 drafter's pre-norm states) has no
# extern "C": its symbols carry C++ (Itanium ABI) names, whose calling convention for these argument types
# is the C one.
_MANGLED = {
    "llama_set_embeddings_layer_inp": "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "llama_get_embeddings_layer_inp": "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
    "llama_set_embeddings_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    "llama_get_embeddings_nextn_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
}


@cache
def load(path: str | None = None) -> C.CDLL:
    """The shared library with its functions declared, the backend initialised and its logging silenced
    (set EAGLESPEC_LLAMACPP_LOG=1 to keep it). Raises RuntimeError with the build command when absent."""
    lib_path = Path(path) if path else library_path()
    if not lib_path.is_file():
        raise RuntimeError(missing_reason(lib_path.parents[2]))
    lib = C.CDLL(str(lib_path))
    for name, (result, args) in _SIGNATURES.items():
        fn = getattr(lib, _MANGLED.get(name, name))
        fn.restype, fn.argtypes = result, args
        setattr(lib, name, fn)
    if not os.environ.get("EAGLESPEC_LLAMACPP_LOG"):
        lib.llama_log_set(_QUIET, None)
    lib.llama_backend_init()
    return lib
