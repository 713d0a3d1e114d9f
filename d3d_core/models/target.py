"""The target model: prefill, verify a block with KV rollback, capture hidden states.

Two engines behind one interface (``Target.forward``), chosen per cache:

- **fast** (CPU, fp32, Llama / Qwen3 layers): our own forward over the Hugging Face model's
  weights — q|k|v and gate|up fused into one prepacked oneDNN GEMM each (``fastops``), a
  preallocated KV cache written in place (rollback moves a length, nothing is copied), RoPE
  tables computed once, GQA attention as one SDPA call per KV head group, and the LM head
  only on the rows whose logits are asked for; small row counts follow a row plan measured on this
  machine (``Target.row_plan``: oneDNN padded to a faster width, or plain BLAS). Every mode, ``ar``
  included, runs through it.
- **int4**: the fast forward with every decoder-layer linear and the LM head run from 4-bit weights taken from
  the bundled GGUF's blocks, through this project's row-invariant low-bit kernel (``lowbit``) where it builds, else
  torch's int4 CPU kernel (``int4``; ``D3D_ENGINE=int4`` / ``engine="int4"``).
- **eager**: the Hugging Face model with its ``DynamicCache`` (GPU, other architectures, or
  ``D3D_ENGINE=eager`` / ``engine="eager"`` for comparison).

The cache always holds the *committed* positions the target has processed; the anchor of the
next block is committed but not yet in the cache (verify feeds it as the block's first token).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from . import fastops, int4, lowbit
from .fastops import LM_HEAD
from .layers import ArchConfig, SharedParts

ENGINES = ("fast", "eager", "int4")
ROW_PLAN_MIN_MB = 64  # a target whose weights are smaller stays in cache; its row plan is not measured
_ROW_PLANS: dict = {}  # (model type, architecture, threads) -> (plan, info): measured once per process
_ROW_PLAN_LOCK = threading.RLock()
_NO_INT4: dict = {}  # a layer without int4 linears (the fp32 fast engine)
ATTN_BUCKET_ROWS = 64  # forwards over more rows (long prefills, identical in every mode) attend as the fp32 engine does
LOWBIT_ATTN = "lowbit"  # the int4 engine on the low-bit kernel: every row attends alone (lowbit.attention), any row count


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (n, V) float32, one row per fed position (the last n)
    feats: Optional[torch.Tensor]  # (1, n_fed, k*H) hidden states of the chosen layers, or None


@dataclass(frozen=True)
class _FastLinear:
    """One fp32 GEMM of the fast forward: ``fastops.packed_linear`` with its weights and biases looked up once, and
    the packed (oneDNN) or transposed (BLAS) copy it last used kept at hand while no weight changes in place (their
    version counters), so a step's 120 GEMMs skip the per-call cache lookup."""

    owner: torch.nn.Module  # where fastops caches the packed / BLAS copies
    key: str
    weights: tuple
    biases: tuple
    prep: object = None  # reorders the concatenated rows once (q|k|v: the rotary halves interleaved)
    held: dict = field(default_factory=dict, compare=False)  # "blas" / "onednn" -> (versions, weight copy, bias)

    def __call__(self, x: torch.Tensor, plan) -> torch.Tensor:  # x (m, K) -> (m, N)
        lib = "blas" if x.shape[0] in plan.blas else "onednn"
        versions = [t._version for t in self.weights] + [t._version for t in self.biases if t is not None]
        hit = self.held.get(lib)
        if hit is None or hit[0] != versions:
            hit = self.held[lib] = (versions, *fastops._packed(self.owner, self.key, self.weights, self.biases, self.prep, lib))
        return fastops.run_blas(hit[1], hit[2], x) if lib == "blas" else fastops.run_onednn(hit[1], hit[2], x, plan)


@dataclass(frozen=True)
class _FastLayer:
    """A decoder layer's parts as the fast forward uses them, looked up once (no nn.Module attribute walk per forward)."""

    attn: torch.nn.Module
    ln1: torch.Tensor  # input RMSNorm weight
    ln2: torch.Tensor  # post-attention RMSNorm weight
    qkv: _FastLinear  # q|k|v fused, rotary halves interleaved
    o: _FastLinear
    gate_up: _FastLinear  # gate|up fused
    down: _FastLinear

    @classmethod
    def of(cls, layer, prep_qkv) -> "_FastLayer":
        a, mlp = layer.self_attn, layer.mlp
        return cls(a, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   _FastLinear(a, "qkv_rope", (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                               prep_qkv),
                   _FastLinear(a.o_proj, "w", (a.o_proj.weight,), (a.o_proj.bias,)),
                   _FastLinear(mlp, "gate_up", (mlp.gate_proj.weight, mlp.up_proj.weight), (mlp.gate_proj.bias, mlp.up_proj.bias)),
                   _FastLinear(mlp.down_proj, "w", (mlp.down_proj.weight,), (mlp.down_proj.bias,)))


class StaticKV:
    """Preallocated per-layer K/V for one sequence (fast engine): k[i], v[i] are (1, nkv, capacity, hd) (SDPA's own
    4-D layout, so attention reads them without a view per layer),
    positions 0..length-1 are valid. Grows by doubling; rollback only moves ``length``. Speaks the
    two methods of HF's cache that ``Target`` uses (``get_seq_length``, ``crop``)."""

    def __init__(self, n_layers: int, nkv: int, hd: int, dtype, device, capacity: int = 512):
        # zeros, not empty: the int4 engine attends over masked positions past the length, which must hold finite values
        self.k = [torch.zeros(1, nkv, capacity, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(1, nkv, capacity, hd, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0
        self.int4 = None  # the int4 engine's weights (Int4Weights) when this cache belongs to an int4 decode

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def reserve(self, n: int) -> None:
        need = self.length + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for kv in (self.k, self.v):
            for i, t in enumerate(kv):
                new = t.new_zeros(1, t.shape[1], cap, t.shape[3])
                new[:, :, : self.length] = t[:, :, : self.length]
                kv[i] = new

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """HF semantics: a negative value removes that many positions, a positive one keeps that many."""
        keep = self.length + max_length if max_length < 0 else min(max_length, self.length)
        self.length = max(0, keep)


class Target:
    def __init__(self, model, name: str = "target", engine: str = "fast"):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        self.engine_request = engine
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.name = name
        self.config = model.config
        self.arch = ArchConfig.from_hf(model.config)
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = base.layers
        self.final_norm = base.norm
        self.shared = SharedParts(model.get_input_embeddings(), model.get_output_embeddings(), base.rotary_emb, base.layers, base.norm)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 4096))
        self._row_plan, self.row_plan_info = None, {}  # fixed by row_plan() before the first fast forward
        # the int4 engine: where its weights come from (int4.GGUFSource, int4.QUANTIZE_FP32 or None), loaded on first use
        self.int4_source = None
        self._int4, self._int4_error = None, None
        self._int4_lock = threading.Lock()

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return self.arch.num_target_layers

    @property
    def engine(self) -> str:
        """The engine new caches get: "fast" where it can run (CPU, fp32, Llama / Qwen3 layers,
        oneDNN present and not switched off), else "eager"; "int4" when asked for (``engine="int4"`` or
        ``D3D_ENGINE=int4``) and this target has int4 weights (``int4_reason`` says why not)."""
        if self.fast_reason() is not None:
            return "eager"
        return "int4" if self.int4_wanted() and self.int4_reason() is None else "fast"

    def int4_wanted(self) -> bool:
        """int4 asked for: by this target (``engine="int4"``), or process-wide (``D3D_ENGINE=int4``) unless this
        target asked for ``"fp32"`` (the fast engine, never int4: the app's per-race engine choice)."""
        return self.engine_request == "int4" or (self.engine_request == "fast" and fastops.int4_requested())

    def int4_reason(self) -> Optional[str]:
        """None when the int4 engine can run this target (weights loaded or loadable), else why not."""
        if self.int4_source is None:
            return "no 4-bit source for this target (the int4 engine reads the bundled GGUF's blocks)"
        ok, why = int4.usable()
        if not ok:
            return why
        return self._int4_error

    def int4_weights(self):
        """The int4 weights (loaded once: from the packed cache, or converted from the GGUF and cached). Attaches
        the head to the LM head module, so the drafters' shared head runs int4 too while int4 is on."""
        if self._int4 is None and self._int4_error is None:
            with self._int4_lock:
                if self._int4 is None and self._int4_error is None:
                    try:
                        w = int4.load(self, self.int4_source)
                    except Exception as e:  # an unreadable GGUF or cache: stay on the fp32 engine, say why
                        self._int4_error = f"int4 weights failed to load ({type(e).__name__}: {str(e)[:160]})"
                        return None
                    if w.head is not None:
                        self.shared.lm_head._d3d_int4 = w.head
                    self._int4 = w
        return self._int4

    def int4_info(self) -> dict:
        """What runs int4 and what stays as it was (for the bench and the app), or why int4 is off."""
        if self._int4 is not None:
            return {"kernel": self._int4.info.get("kernel", int4.kernel_status().kernel), **self._int4.info}
        return {"off": self.int4_reason() or ("not requested" if not self.int4_wanted() else "not loaded yet")}

    def fast_reason(self) -> Optional[str]:
        """None when the fast engine applies, else why not (shown by the app and the bench)."""
        if self.engine_request == "eager":
            return "eager engine requested"
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return f"fast engine is CPU fp32 only (this target: {self.device.type}, {self.dtype})"
        if self.config.model_type not in ("llama", "qwen3"):
            return f"fast engine implements Llama / Qwen3 layers, not {self.config.model_type}"
        st = fastops.status()
        return None if st["engine"] == "fast" else st["reason"]

    def new_cache(self):
        eng = self.engine
        if eng == "int4" and self.int4_weights() is None:  # failed to load: int4_reason says why
            eng = "fast"
        if eng in ("fast", "int4"):
            self._fast_tables()
            kv = StaticKV(len(self.layers), self.arch.num_key_value_heads, self.arch.head_dim, self.dtype, self.device)
            kv.int4 = self._int4 if eng == "int4" else None
            return kv
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(self, cache, ids: torch.Tensor, n_logits: int, feature_layers: tuple = ()) -> TargetOutput:
        """Feed ids (n,) after the cached positions; return logits for the last n_logits
        positions and, when feature_layers is given, their hidden states (all n fed)."""
        if isinstance(cache, StaticKV):
            return self._forward_fast(cache, ids, n_logits, feature_layers)
        ids = ids.to(self.device)[None]
        out = self.model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=n_logits,
            output_hidden_states=bool(feature_layers),
        )
        feats = None
        if feature_layers:
            # hidden_states[0] is the embedding output; layer l's output is hidden_states[l + 1]
            feats = torch.cat([out.hidden_states[l + 1] for l in feature_layers], dim=-1)
        return TargetOutput(out.logits[0].float(), feats)

    # ------------------------------------------------------------------ the fast engine

    def _fast_tables(self) -> None:
        """RoPE as complex rotations for every position, computed once with the model's own rotary
        embedding. The fast engine stores q and k with each head's two rotary halves interleaved
        (the q/k weight rows are permuted once when packed; q·k is unchanged by a permutation
        applied to both), so RoPE is one complex multiply over q and k together."""
        if getattr(self, "_freqs", None) is None:
            pos = torch.arange(self.max_positions, device=self.device)[None]
            like = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.shared.rotary_emb(like, pos)  # (1, P, hd), rotate_half convention
            half = self.arch.head_dim // 2
            self._freqs = torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())  # (P, hd/2)
            self._perm = torch.stack([torch.arange(half), torch.arange(half) + half], -1).flatten()  # (hd,)
            # each layer's modules and norm weights, looked up once instead of per forward
            self._fast_layers = [_FastLayer.of(l, self._prep_qkv) for l in self.layers]
            # Qwen3's per-head q / k norm weights, in the same interleaved order (None for Llama)
            self._qk_norm = [None if getattr(l.self_attn, "q_norm", None) is None else
                             (l.self_attn.q_norm.weight[self._perm], l.self_attn.k_norm.weight[self._perm]) for l in self.layers]

    def _prep_qkv(self, w, b):
        """Interleave the rotary halves of every q and k head's rows (v rows unchanged)."""
        hd, n_qk = self.arch.head_dim, self.arch.num_attention_heads + self.arch.num_key_value_heads
        idx = torch.cat([h * hd + self._perm for h in range(n_qk)] + [torch.arange(n_qk * hd, w.shape[0])])
        return w[idx], (b[idx] if b is not None else None)

    def row_plan(self) -> fastops.RowPlan:
        """The row plan this target's fast forward runs small row counts by (``fastops.RowPlan``: m rows on plain
        BLAS when m is in ``plan.blas``, else on oneDNN at ``plan.rows[m]`` rows), fixed before the first fast forward
        so every forward of the process, in every mode, runs the same kernels. ``row_plan_info`` says how it was chosen."""
        if self._row_plan is None:
            with _ROW_PLAN_LOCK:
                if self._row_plan is None:
                    plan, self.row_plan_info = self._choose_row_plan()
                    self._row_plan = plan
        return self._row_plan

    def _choose_row_plan(self) -> tuple:  # (RowPlan, info)
        setting = fastops.row_plan_setting()
        if setting == "off":
            return fastops.IDENTITY_PLAN, {"setting": "off", **fastops.IDENTITY_PLAN.info(), "why": "D3D_ROW_PLAN=off: oneDNN at every row count"}
        if setting == "blas":
            return fastops.BLAS_PLAN, {"setting": "blas", **fastops.BLAS_PLAN.info(),
                                       "why": f"D3D_ROW_PLAN=blas: plain BLAS up to {fastops.ROW_PLAN_MAX} rows"}
        if setting.isdigit():
            plan = fastops.fixed_plan(int(setting))
            return plan, {"setting": setting, **plan.info(), "why": f"D3D_ROW_PLAN={setting}: every row count below it runs at it"}
        weight_mb = sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2**20
        if weight_mb < ROW_PLAN_MIN_MB:  # a toy target sits in cache: its timings would be noise
            return fastops.IDENTITY_PLAN, {"setting": "auto", **fastops.IDENTITY_PLAN.info(),
                                           "why": f"weights ({weight_mb:.0f} MB) under {ROW_PLAN_MIN_MB} MB: not measured"}
        key = (self.config.model_type, self.arch, torch.get_num_threads())
        if key not in _ROW_PLANS:
            _ROW_PLANS[key] = self._measure_row_plan()
        plan = _ROW_PLANS[key][0]
        if not plan.blas:  # the measurement built BLAS copies of every weight; a plan that never uses them frees them
            self.drop_blas()
        return _ROW_PLANS[key]

    def drop_blas(self) -> int:
        """Free the fast forward's BLAS weight copies (rebuilt if a forward needs them again); bytes freed."""
        for fl in getattr(self, "_fast_layers", None) or []:
            for lin in (fl.qkv, fl.o, fl.gate_up, fl.down):
                lin.held.pop("blas", None)
        return fastops.drop_blas(self.model)

    def _measure_row_plan(self, ctx: int = 64, repeats: int = 4) -> tuple:  # (RowPlan, info)
        """Time this target's fast forward over m = 1..ROW_PLAN_MAX rows through oneDNN (unpadded) and through plain
        BLAS, after a ``ctx``-token prefill that also packs every weight (widths and libraries interleaved, the
        fastest of ``repeats``: other work on the machine only ever adds time), and give each m the forward that ran
        fastest (fastops.plan_from_times)."""
        t0 = time.perf_counter()
        cache = self.new_cache()
        cache.int4 = None  # the plan is the fp32 engine's, whatever engine new caches get now
        ids = torch.arange(ctx + fastops.ROW_PLAN_MAX) % self.arch.vocab_size
        self._forward_fast(cache, ids[:ctx], 1, (), fastops.IDENTITY_PLAN)
        plans = {"onednn": fastops.IDENTITY_PLAN, "blas": fastops.BLAS_PLAN}
        times = {(lib, m): [] for m in range(1, fastops.ROW_PLAN_MAX + 1) for lib in plans}
        for rep in range(repeats + 1):  # the first pass builds each shape's kernels (and the BLAS copies): not counted
            for lib, m in times:
                t1 = time.perf_counter()
                self._forward_fast(cache, ids[ctx : ctx + m], m, (), plans[lib])
                if rep:
                    times[(lib, m)].append((time.perf_counter() - t1) * 1e3)
                cache.length = ctx
        best = {lib: {m: min(times[(lib, m)]) for m in range(1, fastops.ROW_PLAN_MAX + 1)} for lib in plans}
        plan = fastops.plan_from_times(best["onednn"], best["blas"])
        return plan, {"setting": "auto", **plan.info(), "forward_ms": best["onednn"], "blas_forward_ms": best["blas"],
                      "threads": torch.get_num_threads(), "calibrate_ms": (time.perf_counter() - t0) * 1e3,
                      "why": "measured: this target's forward over 1..8 rows through oneDNN and plain BLAS on this machine "
                             "(Target.row_plan)"}

    def _forward_fast(self, cache: StaticKV, ids: torch.Tensor, n_logits: int, feature_layers: tuple,
                      plan: Optional[fastops.RowPlan] = None) -> TargetOutput:
        w4 = cache.int4  # the int4 engine's weights, or None (fp32): int4 GEMMs compute each row alone, no row plan
        if w4 is None:
            plan = plan or self.row_plan()
        n, T = ids.shape[0], cache.length
        if T + n > self.max_positions:
            raise ValueError(f"context of {T + n} positions exceeds the target's {self.max_positions}")
        groups = None
        if w4 is not None and n <= ATTN_BUCKET_ROWS:
            groups = LOWBIT_ATTN if w4.kernel == "lowbit" else int4.attention_groups(T, n, self.arch.num_attention_heads // self.arch.num_key_value_heads)
        cache.reserve(groups[-1][2] - T if isinstance(groups, list) else n)
        eps, H = self.arch.rms_norm_eps, (self.arch.hidden_size,)
        x = self.shared.embed_tokens(ids.to(self.device))  # (n, H)
        rot = self._freqs[T : T + n, None]  # (n, 1, hd/2) complex
        mask = groups
        if groups is None and n > 1:  # causal inside the fed tokens; every cached position is visible
            mask = torch.zeros(n, T + n, dtype=x.dtype, device=x.device)
            mask[:, T:] = torch.full((n, n), float("-inf"), dtype=x.dtype, device=x.device).triu_(1)
            mask = mask.repeat(self.arch.num_attention_heads // self.arch.num_key_value_heads, 1)  # one row per stacked query head
        feats = {}
        # the low-bit engine's decode-sized forwards (each row attending alone): the glue in C too, row by row. A longer
        # prefill keeps SDPA over a causal mask (its rows are computed once, so they need no row invariance)
        lib = lowbit.library() if groups is LOWBIT_ATTN and x.dtype == torch.float32 else None
        if lib is not None:
            stack = self._lowbit_stack(w4)
            if stack is not None and not torch.autograd.profiler._is_profiler_enabled:
                x = x.contiguous()
                f = stack.run(lib, x, cache.k, cache.v, T, self._rope_pairs[T : T + n], self.arch.head_dim**-0.5, tuple(feature_layers))
                feats.update({i: f[:, j * x.shape[1] : (j + 1) * x.shape[1]] for j, i in enumerate(sorted(feature_layers))})
            else:  # op by op (Qwen3's q / k norms; and under a profiler, so the cost breakdown can time each kernel)
                x = self._layers_lowbit(lib, x.contiguous(), w4, cache, T, rot, feature_layers, feats)
        for i, fl in enumerate(self._fast_layers if lib is None else ()):
            q4 = w4.layers[i] if w4 is not None else _NO_INT4
            h = F.rms_norm(x, H, fl.ln1, eps)
            x = x + self._attention(fl, h, cache, i, T, rot, mask, plan, q4)
            h = F.rms_norm(x, H, fl.ln2, eps)
            lin = q4.get("gate_up")
            if lin is not None:  # fp32 out (lowbit) or bf16 (torch's kernel); silu and the product in fp32
                gate, up = lin(h).chunk(2, dim=-1)
                act = F.silu(gate.float(), inplace=True).mul_(up)
            else:
                gate, up = fl.gate_up(h, plan).chunk(2, dim=-1)
                act = F.silu(gate, inplace=True).mul_(up)  # in place on the GEMM's output: no new buffers
            lin = q4.get("down")
            # the residual stream stays fp32 (fp32 + bf16 promotes)
            x = x + (lin(act) if lin is not None else fl.down(act, plan))
            if i in feature_layers:
                feats[i] = x
        cache.length = T + n
        with record_function(LM_HEAD):
            if lib is not None:
                h = lowbit.add_rmsnorm(lib, x[n - n_logits :], None, self.final_norm.weight, eps)
            else:
                h = F.rms_norm(x[n - n_logits :], H, self.final_norm.weight, eps)
            if w4 is not None and w4.head is not None:
                logits = w4.head(h)  # (n_logits, V) fp32 (lowbit) or bf16 (torch's kernel)
            else:
                # the head stays on oneDNN (BLAS was no faster for it at 1 row and slower at more, on the Xeon)
                logits = fastops.packed_linear(self.shared.lm_head, "w", [self.shared.lm_head.weight], [None], h, plan=plan.onednn())  # (n_logits, V)
        f = torch.cat([feats[l] for l in feature_layers], dim=-1)[None] if feature_layers else None
        return TargetOutput(logits.float(), f)

    def _lowbit_stack(self, w4) -> Optional["lowbit.LayerStack"]:
        """The layers as one ``lowbit.LayerStack`` call (built once per int4 weights; ``int4.layer_stack``), or None."""
        got = getattr(self, "_stack", None)
        if got is None or got[0] is not w4:
            plain = all(qn is None for qn in self._qk_norm) and not any(l.self_attn.q_proj.bias is not None for l in self.layers)
            self._rope_pairs = torch.view_as_real(self._freqs).contiguous()  # (P, hd/2, 2) (cos, sin)
            self._stack = got = (w4, int4.layer_stack(w4, self._fast_layers, self.arch) if plain else None)
        return got[1]

    def _layers_lowbit(self, lib, x: torch.Tensor, w4, cache: StaticKV, T: int, rot, feature_layers: tuple, feats: dict) -> torch.Tensor:
        """The layers on the low-bit kernel op by op: x (n, H) fp32 -> the residual stream after the last layer (x updated
        in place by ``lowbit.add_rmsnorm``; SwiGLU by ``lowbit.swiglu``); every row alone, as ``lowbit.LayerStack``."""
        eps = self.arch.rms_norm_eps
        pending = None  # the last sublayer's output, not yet added to x
        for i, fl in enumerate(self._fast_layers):
            q4 = w4.layers[i]
            h = lowbit.add_rmsnorm(lib, x, pending, fl.ln1, eps)
            a = self._attention(fl, h, cache, i, T, rot, LOWBIT_ATTN, None, q4)
            h = lowbit.add_rmsnorm(lib, x, a, fl.ln2, eps)
            pending = q4["down"](lowbit.swiglu(lib, q4["gate_up"](h)))
            if i in feature_layers:
                x.add_(pending)
                pending = None
                feats[i] = x.clone()
        if pending is not None:
            x.add_(pending)
        return x

    def _attention(self, fl: "_FastLayer", x, cache: StaticKV, i: int, T: int, rot, mask, plan: fastops.RowPlan, q4: dict = None):
        """x: (n, H) normed -> (n, H). Writes this forward's K/V at positions T..T+n-1. ``q4``: this layer's int4
        linears (the int4 engine; the output may then be bf16)."""
        n = x.shape[0]
        nh, nkv, hd = self.arch.num_attention_heads, self.arch.num_key_value_heads, self.arch.head_dim
        q4 = q4 or _NO_INT4
        lin = q4.get("qkv")
        if lin is not None:
            qkv = lin(x).float()  # RoPE's complex multiply and the fp32 KV cache want fp32
        else:
            qkv = fl.qkv(x, plan)
        qn = self._qk_norm[i]
        if qn is None:  # RoPE in place on qkv's q|k columns: one complex multiply, no copy
            qk = qkv[:, : (nh + nkv) * hd].view(n, nh + nkv, hd)
            torch.view_as_complex(qk.view(n, nh + nkv, hd // 2, 2)).mul_(rot)
        else:  # Qwen3: per-head RMSNorm before RoPE
            qk = qkv[:, : (nh + nkv) * hd].reshape(n, nh + nkv, hd)
            qk = torch.cat([F.rms_norm(qk[:, :nh], (hd,), qn[0], fl.attn.q_norm.variance_epsilon),
                            F.rms_norm(qk[:, nh:], (hd,), qn[1], fl.attn.k_norm.variance_epsilon)], 1)
            qk = torch.view_as_real(torch.view_as_complex(qk.reshape(n, nh + nkv, hd // 2, 2)) * rot).reshape(n, nh + nkv, hd)
        kc, vc = cache.k[i], cache.v[i]  # (1, nkv, capacity, hd)
        kc[0, :, T : T + n] = qk[:, nh:].transpose(0, 1)
        vc[0, :, T : T + n] = qkv[:, (nh + nkv) * hd :].reshape(n, nkv, hd).transpose(0, 1)
        g = nh // nkv  # query heads per KV head: stack them as extra query rows, no K/V copies
        if mask is LOWBIT_ATTN:  # each row alone, keys 0..its position, the same bits at any row count
            y = lowbit.attention(qk, nh, kc, vc, T)
        elif isinstance(mask, list):  # the int4 engine on torch's kernel: each row its own SDPA call (see int4.attention_groups)
            ys = []
            for a, b, L, m in mask:
                q = qk[a:b, :nh].transpose(0, 1).reshape(nkv, g * (b - a), hd)
                ys.append(F.scaled_dot_product_attention(q[None], kc[:, :, :L], vc[:, :, :L], attn_mask=m).reshape(nh, b - a, hd))
            y = (ys[0] if len(ys) == 1 else torch.cat(ys, 1)).transpose(0, 1).reshape(n, nh * hd)
        else:
            q = qk[:, :nh].transpose(0, 1).reshape(nkv, g * n, hd)
            y = F.scaled_dot_product_attention(q[None], kc[:, :, : T + n], vc[:, :, : T + n], attn_mask=mask)  # (1, nkv, g*n, hd)
            y = y.reshape(nh, n, hd).transpose(0, 1).reshape(n, nh * hd)
        lin = q4.get("o")
        if lin is not None:
            return lin(y)
        return fl.o(y, plan)

    # ------------------------------------------------------------------ the decode API

    def prefill(self, cache, prompt_ids: torch.Tensor, feature_layers: tuple = ()) -> TargetOutput:
        """Process the prompt; logits (1, V) predict the first output token."""
        return self.forward(cache, prompt_ids, 1, feature_layers)

    def verify(self, cache, block_ids: torch.Tensor, feature_layers: tuple = ()) -> TargetOutput:
        """Feed [anchor, d_1..d_{B-1}]; logits (B, V): row k predicts position s+k+1."""
        return self.forward(cache, block_ids, block_ids.shape[0], feature_layers)

    @staticmethod
    def rollback(cache, n_remove: int) -> None:
        """Drop the last n_remove positions (rejected drafts). crop() wants a negative count."""
        if n_remove > 0:
            cache.crop(-n_remove)

    @staticmethod
    def cache_len(cache) -> int:
        return cache.get_seq_length()

