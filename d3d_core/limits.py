"""Every limit in one place: what the engine accepts, what the app offers, what an untrusted
trace may hold. The engine (``config.DecodeConfig``, the tokenizer), the CLI and the app all read
these names; nothing else writes a bound as a literal."""

import os

# ---- the engine (any caller: CLI, API, tests)
MAX_NEW_TOKENS = 512
BLOCK_MIN, BLOCK_MAX = 2, 64
MAX_HYPOTHESES = 32
MAX_PROMPT_CHARS = 20_000  # hard limit of the tokenizer wrapper
TEMPERATURE_MAX = 2.0

# ---- the app (a shared demo: smaller than the engine's)
APP_BLOCK_MAX = 16
APP_PROMPT_CHARS = 4_000
APP_UPLOAD_BYTES = 20_000_000
APP_QUEUE_MAX = 16  # events waiting in the queue; one more gets "Queue is full … try again" at once
APP_CONCURRENCY = 2  # events running at once (decodes share one lane, see app/ui.py)
# a race's speedup needs this many timed rounds in ar and in the mode; fewer and the app says "too short to time"
# instead of a ratio (a handful of rounds is a handful of noisy samples: see ``measure.reading``)
RACE_MIN_TIMED_ROUNDS = 8
RACE_SPREAD_RESAMPLES = 400  # round-level bootstrap resamples behind a race speedup's 10–90 % spread
# the Race tab's engines (``service.race(engine=...)``): the fp32 fast engine, or the int4 engine (the bundled GGUF's
# 4-bit blocks); the app's default is $D3D_ENGINE when set to one of them, else APP_ENGINE_DEFAULT
APP_ENGINES = ("fp32", "int4")
# int4: speculation is judged against the fastest ar this app has (a faster baseline is the fairer one; on the quiet
# Xeon int4 ar is 2.15x fp32 ar and 0.76x llama.cpp, 2026-12-06, commit ead46de, docs/ENGINE.md); fp32 shows the same rounds against a slower target
APP_ENGINE_DEFAULT = "int4"
# the Pruning tab's live τ: a drafter of at most this many layers is measured on every calibration sequence, a deeper
# one (d3d-deep, 30) on as many as keep layers × sequences the same, so each toggle answers in about the same time
LIVE_TAU_LAYERS = 8
APP_RACE_SECONDS = 120  # wall-clock cap per race: the longest a visitor holds the decode lane
APP_SESSION_TTL_S = 3600  # a visitor's traces are dropped this long after their last change
# oneDNN's and ideep's kernel caches keep one compiled kernel per input shape, up to 1024 each by
# default: a server fed prompts of every length grows for thousands of races before that bound.
# The app keeps this many (a race uses ~50 shapes, so decoding still never recompiles a kernel).
APP_KERNEL_CACHE = 128
# trace downloads / race exports (the app's and Gradio's copies) older than this are deleted
APP_TEMP_MAX_AGE_S = max(10, int(os.environ.get("D3D_TEMP_MAX_AGE_S", "900")))

# ---- the low-bit GEMM (d3d_core/models/lowbit.py): the shapes its kernel accepts (SmolLM2-135M: N <= 49152, K <= 1536;
# rows: a long prefill of the engine's largest prompt)
LOWBIT_MAX_ROWS = 1 << 15
LOWBIT_MAX_N = 1 << 20
LOWBIT_MAX_K = 1 << 16

# ---- loading a bundle (d3d_core/models/hardware.py): checked before anything is downloaded or loaded
# a load needs its weights' bytes (parameters x dtype size) times this margin: conversion copies, KV caches, activations,
# allocator slack (the GGUF conversion of smollm2-135m peaks at about 2x its fp32 weights for a moment)
LOAD_MEMORY_MARGIN = 1.3
LOAD_RESERVE_RAM_BYTES = 1 << 30  # RAM the server keeps for itself (Gradio, the other visitors' races) after any load
LOAD_RESERVE_GPU_BYTES = 1 << 30  # GPU memory kept free after a load (CUDA context, caching allocator)
# On ZeroGPU the main process may not touch CUDA, so free GPU memory cannot be asked: the smallest slice a ZeroGPU
# call gets is assumed instead (half an RTX Pro 6000 Blackwell, 48 GB, less the CUDA context)
ZEROGPU_MEMORY_BYTES = 44 << 30

# ---- untrusted traces (an honest 512-token, B=16, H=32 trace is far below these)
MAX_TRACE_BYTES = APP_UPLOAD_BYTES
MAX_TRACE_ROUNDS = 5_000
MAX_TRACE_TOKENS = 50_000
MAX_TRACE_SPANS = 20_000
MAX_TRACE_HYPOTHESES = 64
MAX_TRACE_BLOCK = BLOCK_MAX + 1

APP_LIMITS = dict(block_min=BLOCK_MIN, block_max=APP_BLOCK_MAX, h_min=1, h_max=MAX_HYPOTHESES,
                  max_new_max=MAX_NEW_TOKENS, prompt_chars_max=APP_PROMPT_CHARS, upload_bytes_max=APP_UPLOAD_BYTES)
