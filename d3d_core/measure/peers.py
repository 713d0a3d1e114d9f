"""Peers: what a user would run instead, on the same target, prompts and machine.

- ``hf-generate``: Hugging Face ``generate``, plain greedy (the eager HF forward and cache);
- ``hf-prompt-lookup``: its built-in speculative variant that needs no extra model
  (``prompt_lookup_num_tokens``: drafts are n-gram copies from the prompt);
- ``llama-cpp``: llama.cpp (``llama-cpp-python``) on the bundle's own GGUF, greedy, the same threads;
- ``llama-cpp-lookup``: llama.cpp with its prompt-lookup speculative decoding
  (``LlamaPromptLookupDecoding``, n-gram drafts from the context, verified in one batch).

``--peers llama-cpp`` names both llama.cpp rows. llama.cpp is an optional install (it compiles for
about five minutes on two cores: ``scripts/setup_venv.sh --llama-cpp``); when it is absent the bench
says so, with that command, and runs without it. Its rows are timed the way ours are: the time to
the first token (prefill + one token) is left out, the rest is decode time.

Their rows have the bench's shape. Decode time excludes prefill the way our modes do: the time
of ``generate(max_new_tokens=1)`` (prefill + first token) is subtracted from the full call.
``lossless`` says whether their tokens equal our ``ar`` tokens (the fast engine's greedy
tokens); a difference means the two forwards' rounding differs on a near-tie, and the bench
reports how often that happens. τ is not observable through ``generate``, so it is left empty.
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import sys
import time
from typing import Optional

import torch

HF_PEERS = ("hf-generate", "hf-prompt-lookup")
LLAMA_PEERS = ("llama-cpp", "llama-cpp-lookup")
PEERS = HF_PEERS + LLAMA_PEERS
PROMPT_LOOKUP_TOKENS = 10  # n-gram draft length (the value HF's docs use; llama-cpp-python's own default is 10 too)
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_INSTALL = ("llama.cpp is not installed (an optional peer): `scripts/setup_venv.sh --llama-cpp` adds "
                     f"llama-cpp-python=={LLAMA_CPP_VERSION} to .venv (it compiles for about 5 minutes on two cores)")


def parse_peers(text: str) -> list:
    """``--peers`` -> peer names: a comma list of :data:`PEERS`, where ``llama-cpp`` names both llama.cpp rows
    (plain and prompt lookup), or 'none'. Unknown names raise ValueError."""
    if text.strip() in ("", "none"):
        return []
    out: list = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        names = LLAMA_PEERS if x == "llama-cpp" else (x,)
        for n in names:
            if n not in PEERS:
                raise ValueError(f"unknown peer {n!r}; choose from {', '.join(PEERS)} or 'none'")
            if n not in out:
                out.append(n)
    return out


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def gguf_of(bundle):
    """The GGUF file the bundle's target came from, or None (toy and hub bundles have none)."""
    src = getattr(bundle.target, "int4_source", None)
    return getattr(src, "gguf", None)


def usable_peers(bundle, peers: list, warn=print) -> list:
    """The peers this bundle and this install can run; each one dropped is said once, with why and how to add it."""
    if not any(p in LLAMA_PEERS for p in peers):
        return list(peers)
    why = None
    if not llama_cpp_available():
        why = LLAMA_CPP_INSTALL
    elif gguf_of(bundle) is None:
        why = f"the llama.cpp peers need a GGUF target and bundle {bundle.name!r} has none"
    else:
        why = llama_cpp_broken(gguf_of(bundle))
    if why is None:
        return list(peers)
    warn(f"note: skipping {', '.join(p for p in peers if p in LLAMA_PEERS)}: {why}")
    return [p for p in peers if p not in LLAMA_PEERS]


_PROBED: dict = {}


def llama_cpp_broken(gguf) -> Optional[str]:
    """None when the installed llama.cpp decodes ``gguf`` on this CPU, else why not. Probed once per process in a
    child process: a build for instructions this machine cannot run (AMX tiles inside a VM that does not enable
    them) dies of SIGILL, which would otherwise take the whole bench down after its measurements."""
    key = str(gguf)
    if key not in _PROBED:
        code = ("import sys; from llama_cpp import Llama; m = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False); "
                "g = m.generate([1, 2, 3], temp=0.0); next(g); print('ok')")
        try:
            r = subprocess.run([sys.executable, "-c", code, key], capture_output=True, text=True, timeout=120)
            ok = r.returncode == 0 and r.stdout.strip().endswith("ok")
            why = None if ok else (
                "the installed llama.cpp cannot run on this CPU (killed by SIGILL: it was built for instructions this machine "
                "does not allow; `scripts/setup_venv.sh --llama-cpp --rebuild` builds it again without AMX)" if r.returncode == -signal.SIGILL
                else f"the installed llama.cpp failed a one-token test (exit {r.returncode}: {(r.stderr or '').strip()[-200:]})")
        except subprocess.TimeoutExpired:
            why = "the installed llama.cpp did not decode one token within 120 s"
        _PROBED[key] = why
    return _PROBED[key]


_LLAMAS: dict = {}


def close_llamas() -> None:
    """Free the cached llama.cpp models while the interpreter is still whole (registered with ``atexit``). Left to the
    garbage collector at exit, llama-cpp-python's destructor runs after its own module globals are gone and prints
    "Exception ignored ... 'NoneType' object is not callable" tracebacks after the bench's last line."""
    while _LLAMAS:
        _, model = _LLAMAS.popitem()
        try:
            model.close()
        except Exception:  # a model that cannot close cleanly at exit: nothing left to report it to
            pass


atexit.register(close_llamas)


def _llama(gguf, threads: int, lookup: bool):
    """One llama.cpp model per (GGUF, threads, lookup), loaded once (the load is not part of any timing)."""
    key = (str(gguf), threads, lookup)
    if key not in _LLAMAS:
        from llama_cpp import Llama

        kw = {}
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)
            kw["logits_all"] = True  # its verify reads the logits of every drafted position (without it the scores buffer overflows)
        _LLAMAS[key] = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                             seed=0, verbose=False, **kw)
    return _LLAMAS[key]


def _llama_generate(bundle, ids: list, name: str, max_new_tokens: int, stop_at_eos: bool, threads: int) -> tuple:
    """Greedy llama.cpp decode of ``ids``: (tokens, seconds to the first token, seconds in all)."""
    llm = _llama(gguf_of(bundle), threads, name == "llama-cpp-lookup")
    llm.reset()  # no prefix reuse from the previous prompt: every row pays its own prefill, like ours
    eos = bundle.tokenizer.eos_ids
    out: list = []
    t = time.perf_counter()
    t_first = None
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if t_first is None:
            t_first = time.perf_counter() - t
        if len(out) >= max_new_tokens or (stop_at_eos and tok in eos):
            break
    return out, t_first or 0.0, time.perf_counter() - t


@torch.inference_mode()
def _generate(bundle, ids: list, name: str, max_new_tokens: int, stop_at_eos: bool) -> tuple:
    model = bundle.target.model
    x = torch.tensor([ids], dtype=torch.long, device=bundle.target.device)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(x),
              pad_token_id=0, eos_token_id=sorted(bundle.tokenizer.eos_ids) if stop_at_eos else None)
    if not stop_at_eos:
        kw["min_new_tokens"] = max_new_tokens
    if name == "hf-prompt-lookup":
        kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    t = time.perf_counter()
    out = model.generate(x, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def peer_decode(bundle, name: str, ids: list, cfg) -> tuple:
    """Peer ``name``'s greedy decode of ``ids``: (tokens, seconds to the first token, seconds in all)."""
    if name in LLAMA_PEERS:
        return _llama_generate(bundle, ids, name, cfg.max_new_tokens, cfg.stop_at_eos, cfg.threads or torch.get_num_threads())
    _, t_first = _generate(bundle, ids, name, 1, cfg.stop_at_eos)
    out, t_all = _generate(bundle, ids, name, cfg.max_new_tokens, cfg.stop_at_eos)
    return out, t_first, t_all


def run_peer(bundle, name: str, ids: list, cfg, item, ref_ids) -> dict:
    """One bench row for peer ``name`` on prompt ``ids`` (temperature 0 only)."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    if cfg.temperature > 0:
        raise ValueError("peers run greedy only (temperature 0)")
    out, t_first, t_all = peer_decode(bundle, name, ids, cfg)
    decode_s = max(t_all - t_first, 1e-9)
    return {
        "dataset": item.dataset, "id": item.id, "mode": name, "n_tokens": len(out), "rounds": 0, "tau": None,
        "decode_time_s": decode_s, "prefill_time_s": t_first, "tokens_per_s": (len(out) - 1) / decode_s if len(out) > 1 else 0.0,
        "target_forwards": None, "hit_rate": None, "overlap": None,
        "lossless": None if ref_ids is None else out == ref_ids, "accepted_hist": {}, "span_ms": {},
        "same_prefix": None if ref_ids is None else common_prefix(out, ref_ids),
    }


def common_prefix(a: list, b: list) -> int:
    """How many leading tokens two greedy outputs share (where a peer's rounding first picks another token)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
