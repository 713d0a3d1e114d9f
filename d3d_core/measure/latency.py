"""A latency model: per-token time of each mode from τ, hit rate and a cost profile.

    ar         T_step
    dflash     (T_draft_dflash(B) + T_verify(B)) / τ
    d3d-seq    (T_draft_d3d(B)    + T_verify(B)) / τ
    d3d-async  (max(c_v · T_verify(B), c_p · T_packed(H)) + (1 − hit) · T_draft_d3d(B)) / τ

c_v, c_p ≥ 1 are contention factors: how much slower verify and the packed pass run when they
run at the same time than alone (they share memory bandwidth and caches). The cost probe
measures them (``concurrent_ms``); a profile without them uses 1.

Each round commits τ tokens on average; a sequential round pays draft + verify; an async round
pays the longer of verify and the packed pass, plus a synchronous draft after a miss.
Speedup = T_step / per-token time. Cost profiles are editable presets: one measured on this
project's CPU (the shipped cost breakdown), one **measured** per GPU that ran ``scripts/gpu_check.py``
(its JSON committed under ``docs/gpu/``, named after that GPU: ``measured_gpu_profiles``) and GPU-scale
ones **assumed** from public hardware figures, each with its source and assumptions. Projections are
model-based, not measurements.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from ..decoding.plan import plan_label, plan_of
from ..models.bundles import asset_json
from .rawfirst import Steps
from .tables import table_text


@dataclass(frozen=True)
class CostProfile:
    name: str
    source: str
    assumptions: str
    t_step_ms: float
    t_verify_ms: dict  # B -> ms
    t_draft_d3d_ms: dict  # B -> ms
    t_draft_dflash_ms: dict  # B -> ms
    t_packed_ms: dict  # H -> ms (at block size packed_block)
    packed_block: int = 8
    measured: bool = False
    extra: dict = field(default_factory=dict)

    def at(self, table: dict, key: int) -> float:
        """Value at key; linear interpolation / nearest-edge extrapolation between measured keys."""
        t = {int(k): float(v) for k, v in table.items()}
        if key in t:
            return t[key]
        ks = sorted(t)
        if key <= ks[0]:
            return t[ks[0]]
        if key >= ks[-1]:
            if len(ks) >= 2:  # extend the last slope
                a, b = ks[-2], ks[-1]
                return t[b] + (t[b] - t[a]) / (b - a) * (key - b)
            return t[ks[-1]]
        for a, b in zip(ks, ks[1:]):
            if a < key < b:
                return t[a] + (t[b] - t[a]) * (key - a) / (b - a)
        raise AssertionError("unreachable")

    def scaled(self, verify=1.0, draft=1.0, packed=1.0) -> "CostProfile":
        """The same profile with verify / draft / packed costs multiplied (what-if sliders); named "(scaled)" only when
        a multiplier is not 1 (at 1, 1, 1 it is the profile itself)."""
        if (verify, draft, packed) == (1.0, 1.0, 1.0):
            return self
        return replace(
            self,
            name=self.name + " (scaled)",
            t_verify_ms={k: v * verify for k, v in self.t_verify_ms.items()},
            t_draft_d3d_ms={k: v * draft for k, v in self.t_draft_d3d_ms.items()},
            t_draft_dflash_ms={k: v * draft for k, v in self.t_draft_dflash_ms.items()},
            t_packed_ms={k: v * packed for k, v in self.t_packed_ms.items()},
        )

    def to_json(self) -> dict:
        return asdict(self)


def draft_ms(p: CostProfile, mode: str, B: int) -> float:
    """One draft of a block of B by the mode's drafter (ms)."""
    return p.at(p.t_draft_dflash_ms if mode == "dflash" else p.t_draft_d3d_ms, B)


def async_costs(p: CostProfile, B: int, H: int) -> tuple:
    """(verify, packed pass) ms of one d3d-async round, each slowed by the profile's contention
    factors (run together, both lanes are slower than alone)."""
    v = p.at(p.t_verify_ms, B)
    packed = p.at(p.t_packed_ms, H) * (B / p.packed_block)  # the packed pass grows with the block
    slow = p.extra.get("contention")  # {H: {"verify": x, "packed": y}}
    if slow:
        c = {int(h): x for h, x in slow.items()}
        v *= p.at({h: x["verify"] for h, x in c.items()}, H)
        packed *= p.at({h: x["packed"] for h, x in c.items()}, H)
    return v, packed


def round_ms(p: CostProfile, mode: str, B: int, hit_rate: float = 0.0, H: int = 4) -> float:
    """Expected time of one round (ms)."""
    if mode == "ar":
        return p.t_step_ms
    if mode in ("dflash", "d3d-seq"):
        return draft_ms(p, mode, B) + p.at(p.t_verify_ms, B)
    if mode == "d3d-async":
        return max(async_costs(p, B, H)) + (1.0 - hit_rate) * draft_ms(p, mode, B)
    raise ValueError(f"unknown mode {mode!r}")


def per_token_ms(p: CostProfile, mode: str, B: int, tau: float, hit_rate: float = 0.0, H: int = 4) -> float:
    if mode == "ar":
        return p.t_step_ms
    if tau is None or tau <= 0:
        raise ValueError(f"τ must be positive (got {tau!r}: a peer, or a mode with no round, has nothing to model)")
    return round_ms(p, mode, B, hit_rate, H) / tau


def speedup(p: CostProfile, mode: str, B: int, tau: float, hit_rate: float = 0.0, H: int = 4) -> float:
    return p.t_step_ms / per_token_ms(p, mode, B, tau, hit_rate, H)


def measured_taus(result: Optional[dict], dataset: str = "gsm8k") -> tuple:
    """({mode: τ}, B, where they come from) for each drafting mode of a bench result, measured per mode — the
    projection starts every mode at its own τ, never one τ for all. Where the bench also drafted every round at its
    block size (``--compare-drafting``) those rows give the τ (the model's rounds all draft); else the summary row
    of ``dataset``. Modes the bench did not run are absent."""
    res = result or {}
    dec = (res.get("config") or {}).get("decode") or {}
    B = int(dec.get("block_size") or 8)
    out, src = {}, {}
    for mode in ("dflash", "d3d-seq", "d3d-async"):
        every = [r for r in res.get("rows") or [] if r.get("mode") == mode and r.get("dataset") == dataset
                 and r.get("block_size") == dec.get("block_size") and plan_of(r) == (dec.get("verify"), "always") and r.get("rounds")]
        if every:
            out[mode] = sum(r["tau"] * r["rounds"] for r in every) / sum(r["rounds"] for r in every)
            src[mode] = "drafting every round"
            continue
        row = next((s for s in res.get("summary") or [] if s.get("mode") == mode and s.get("dataset") == dataset), None)
        if row and row.get("tau"):
            out[mode] = float(row["tau"])
            src[mode] = f"{plan_label(plan_of(dec))} table"
    where = f"bench {dataset}, B = {B}: " + ", ".join(f"{m} τ {t:.2f} ({src[m]})" for m, t in out.items()) if out else ""
    if "drafting every round" in src.values():  # not the table's τ: say which rows, so the two numbers do not disagree
        where += (" — drafting every round: the same bench's rows with the draft gate off, whose τ is above the Measured "
                  "bench table's gated τ (that one counts a round the gate skipped as 1); they are " + dataset + "'s alone, so they are "
                  "not the table's '(… drafting always)' rows either, which average every dataset")
    return out, B, where


def project_modes(p: CostProfile, B: int, taus: dict, hit_rate: float, H: int) -> list:
    """Per-token time and speedup of every mode under profile ``p``, each drafting mode at its own τ (``taus``,
    capped to [1, B]); d3d-async with the profile's contention (``async_profile``). Rows: mode, tau, ms_per_token,
    speedup."""
    rows = [{"mode": "ar", "tau": 1.0, "ms_per_token": p.t_step_ms, "speedup": 1.0}]
    for m in ("dflash", "d3d-seq", "d3d-async"):
        if m not in taus:
            continue
        tau = min(max(float(taus[m]), 1.0), float(B))
        t = per_token_ms(async_profile(p) if m == "d3d-async" else p, m, B, tau, hit_rate, H)
        rows.append({"mode": m, "tau": tau, "ms_per_token": t, "speedup": p.t_step_ms / t})
    return rows


def tau_from_hist(hist: dict) -> float:
    """τ from an accepted-length histogram {a: count}."""
    n = sum(hist.values())
    return sum((int(a) + 1) * c for a, c in hist.items()) / n if n else 0.0


# ----------------------------------------------------------------------------- profiles


def profile_from_probe(costs: dict, name: str = "this machine (measured)") -> CostProfile:
    """A profile from the bench's --cost-probe result. Sequential modes use the all-core
    verify; d3d-async uses the one-thread-per-lane verify it actually runs with."""
    return CostProfile(
        name=name, source="python -m d3d_core.measure.bench --cost-probe (median of repeated runs)",
        assumptions=f"context {costs.get('ctx_len')} tokens; sequential modes use {costs.get('threads')} threads; "
                    "the async verify runs on 1 thread (its cost is in extra['verify_1thread_ms'])",
        t_step_ms=float(costs["step_ms"]),
        t_verify_ms={int(k): float(v) for k, v in costs["verify_ms"].items()},
        t_draft_d3d_ms={int(k): float(v) for k, v in costs["d3d_draft_ms"].items()},
        t_draft_dflash_ms={int(k): float(v) for k, v in costs["dflash_draft_ms"].items()},
        t_packed_ms={int(k): float(v) for k, v in costs["packed_ms"].items()},
        packed_block=int(costs.get("packed_block_size", 8)),
        measured=True,
        extra={"verify_1thread_ms": {int(k): float(v) for k, v in costs.get("verify_1thread_ms", {}).items()},
               "d3d_draft_1thread_ms": costs.get("d3d_draft_1thread_ms"),
               "contention": contention(costs)},
    )


def contention(costs: dict) -> dict:
    """{H: {"verify": c_v, "packed": c_p}} from a probe's concurrent timings: each lane's time
    when verify(B) and the packed pass run together, over its time alone on one thread."""
    conc = costs.get("concurrent_ms") or {}
    Bp = str(costs.get("packed_block_size", 8))
    v1 = {str(k): float(v) for k, v in costs.get("verify_1thread_ms", {}).items()}
    packed = {str(k): float(v) for k, v in costs.get("packed_ms", {}).items()}
    if not conc or Bp not in v1:
        return {}
    return {int(h): {"verify": max(1.0, x["verify"] / v1[Bp]), "packed": max(1.0, x["packed"] / packed[str(h)])}
            for h, x in conc.items() if str(h) in packed}


def async_profile(p: CostProfile) -> CostProfile:
    """For d3d-async on a CPU the lanes run one thread each: verify (and the sync draft after a
    miss) cost their one-thread values."""
    v1 = p.extra.get("verify_1thread_ms") or {}
    if not v1:
        return p
    scale = (p.extra.get("d3d_draft_1thread_ms") or p.at(p.t_draft_d3d_ms, p.packed_block)) / p.at(p.t_draft_d3d_ms, p.packed_block)
    return replace(p, t_verify_ms=dict(v1), t_draft_d3d_ms={k: v * scale for k, v in p.t_draft_d3d_ms.items()})


# Derived GPU-scale presets. Decode at batch size 1 is memory-bandwidth bound: a forward reads
# every weight once, so T ≈ bytes / bandwidth + a fixed launch overhead. Sources: NVIDIA H100 SXM
# (3.35 TB/s HBM3) and H200 (4.8 TB/s HBM3e) datasheets; Qwen3-8B has ~8.2 B parameters (36 layers,
# hidden 4096, vocab 151,936) and Qwen3-32B ~32.8 B (64 layers, hidden 5120); bf16 = 2 bytes.
def _gpu_profile(name, params_b, layers, hidden, vocab, bw_tbs, overhead_ms, d3d_layers=8, dflash_layers=5):
    weights_ms = params_b * 2e9 / (bw_tbs * 1e12) * 1e3
    head_ms = vocab * hidden * 2 / (bw_tbs * 1e12) * 1e3
    layer_ms = (weights_ms - 2 * head_ms) / layers
    step = weights_ms * 1.10 + overhead_ms  # ~10 % above the pure weight read (KV, activations)
    verify = {1: step, 2: step * 1.01, 4: step * 1.02, 8: step * 1.04, 16: step * 1.08, 32: step * 1.20}
    d3d = {B: d3d_layers * layer_ms * 1.1 + head_ms + overhead_ms * 0.5 for B in (2, 4, 8, 16)}
    dfl = {B: dflash_layers * layer_ms * 1.1 + head_ms + overhead_ms * 0.5 for B in (2, 4, 8, 16)}
    packed = {H: d3d[8] * (1.0 + 0.02 * H) for H in (1, 2, 4, 8, 16, 32)}
    return CostProfile(
        name=name, source="assumed, not measured: derived from HBM bandwidth datasheets + parameter counts",
        assumptions=(f"bf16 weights read once per forward at {bw_tbs} TB/s, +10 % for KV/activations, "
                     f"{overhead_ms} ms launch overhead per forward (CUDA graphs would cut it); verify of B tokens "
                     f"costs 1–8 % more than a step up to B = 16; drafters: D3D {d3d_layers} target-shaped layers, "
                     f"DFlash {dflash_layers} drafter layers (the public Qwen3-8B drafter's count), each + the LM head; the packed pass grows 2 % per hypothesis "
                     "(still bandwidth bound); drafter and target share the GPU's bandwidth only lightly (two streams)"),
        t_step_ms=step, t_verify_ms=verify, t_draft_d3d_ms=d3d, t_draft_dflash_ms=dfl, t_packed_ms=packed,
    )


def profile_from_breakdown(costs: dict, name: Optional[str] = None) -> Optional[CostProfile]:
    """A profile from ``python -m d3d_core.measure.costs`` output (the shipped
    ``assets/bench/<bundle>-costs.json``): sequential modes at the most threads it measured, d3d-async's
    one-thread verify and draft in ``extra``, lane contention from its overlap probe (verify(B) ‖
    packed pass at H = 1, one thread each, the 8-layer row). None when the file lacks a row it needs."""
    rows = costs.get("rows") or []
    if not rows:
        return None
    top = max(r["threads"] for r in rows)

    def pick(thr, forward=None, prefix=None):
        """{B (or H for the packed pass): wall ms} of the rows at ``thr`` threads."""
        out = {}
        for r in rows:
            if r["threads"] == thr and (r["forward"] == forward if forward else r["forward"].startswith(prefix)):
                key = int(r["forward"].split("=")[1].rstrip(")")) if "packed" in r["forward"] else int(r["B"])
                out[key] = float(r["wall_ms"])
        return out

    step = pick(top, "step").get(1)
    verify = {1: step, **pick(top, prefix="verify")} if step else {}
    d3d, dfl = pick(top, prefix="d3d draft"), pick(top, prefix="dflash draft")
    packed = pick(top, prefix="d3d packed")
    if not (step and d3d and dfl and packed):
        return None
    step1 = pick(1, "step").get(1)
    v1 = {1: step1, **pick(1, prefix="verify")} if step1 else {}
    d1 = pick(1, prefix="d3d draft")
    # a draft's cost is nearly flat in B (the rows are few): the probed width stands for every B
    flat = lambda t: {b: next(iter(t.values())) for b in (2, 4, 8, 16)} if len(t) == 1 else t  # noqa: E731
    extra = {"verify_1thread_ms": v1, "d3d_draft_1thread_ms": next(iter(d1.values()), None)}
    ov = costs.get("overlap") or {}
    row = next((r for r in ov.get("rows", []) if r.get("depth") == 8), None)
    B_ov = ov.get("B", 8)
    p1 = pick(1, prefix="d3d packed")
    if row and v1.get(B_ov) and p1.get(ov.get("H", 1)):
        extra["contention"] = {int(ov.get("H", 1)): {"verify": max(1.0, row["verify_1t_concurrent_ms"] / v1[B_ov]),
                                                     "packed": max(1.0, row["packed_1t_concurrent_ms"] / p1[ov.get("H", 1)])}}
    cpu = (costs.get("machine_info") or {}).get("cpu", "cpu")
    quiet = costs.get("quiet") or {}
    return CostProfile(
        name=name or f"{cpu} {top}-thread (measured)",
        source=f"python -m d3d_core.measure.costs on {cpu}, {costs.get('engine', 'fast')} engine"
               + ("" if not quiet else (" (machine not quiet)" if quiet.get("noisy") else " (quiet machine)")),
        assumptions=f"{costs.get('ctx_len')}-token context, median of {costs.get('repeats')} forwards; sequential modes "
                    f"{top} threads, async 1 thread per lane; the draft was probed at one width and stands for every B; "
                    "lane contention from the overlap probe (verify ‖ packed pass at H = 1) is used for every H",
        t_step_ms=step, t_verify_ms=verify, t_draft_d3d_ms=flat(d3d), t_draft_dflash_ms=flat(dfl), t_packed_ms=packed,
        measured=True, extra=extra,
    )


# ----------------------------------------------------------------------------- measured GPU profiles (scripts/gpu_check.py)

GPU_DOCS = Path(__file__).resolve().parents[2] / "docs" / "gpu"  # where a GPU check's JSON is committed
DFLASH_LAYERS_ESTIMATE = 5  # the public Qwen3-8B DFlash drafter's depth, as the assumed profiles take it


def _layer_params(shape: dict) -> int:
    """Weights of one decoder layer of a gpu_check ``shapes`` entry (attention + MLP; norms are negligible)."""
    h, heads, kv = int(shape["hidden_size"]), int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    hd = int(shape.get("head_dim") or h // heads)
    return h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * int(shape["intermediate_size"])


def _dflash_estimate(step_ms: float, shapes: dict) -> tuple:
    """(ms, how) of a DFlash draft, which the check does not time: the measured step scaled by the weight bytes a
    forward reads (decode at batch 1 is bandwidth bound): DFLASH_LAYERS_ESTIMATE target-shaped layers + the feature
    projection + the LM head, over the target's layers + its head."""
    t, V = shapes["target"], int(shapes["vocab"])
    layer, head, L = _layer_params(t), V * int(t["hidden_size"]), int(t["num_hidden_layers"])
    n = min(DFLASH_LAYERS_ESTIMATE, L)
    fc = n * int(t["hidden_size"]) ** 2
    share = (n * layer + fc + head) / (L * layer + head)
    return step_ms * share, (f"the DFlash draft is not timed by the check: estimated as {share:.2f} × the measured step "
                             f"({n} target-shaped layers + feature projection + LM head over the target's {L} layers + head, weight bytes)")


def gpu_of(data: dict) -> tuple:
    """(GPU name or None, why not a GPU measurement or None) of a gpu_check JSON object. A dry run (toy shapes:
    ``profile`` "dry-run …") or a run on the CPU is refused, whatever else it says."""
    kind = str(data.get("profile") or "")
    dev = str(data.get("device") or "").strip()
    gpu = (data.get("versions") or {}).get("gpu") if isinstance(data.get("versions"), dict) else None
    if kind.startswith("dry-run"):
        where = "the CPU" if dev.lower().startswith("cpu") else (dev or "an unrecorded device")
        return None, f"a dry run of scripts/gpu_check.py (toy shapes on {where}): its timings are not GPU figures"
    if not dev or dev.lower().startswith("cpu"):
        return None, f"it ran on {'the CPU' if dev else 'an unrecorded device'}, not on a GPU"
    if kind != "gpu":
        return None, f"its profile {kind or '(none)'!r} is not the GPU check's ('gpu')"
    if gpu:
        return str(gpu), None
    return (dev if not dev.lower().startswith("cuda") else "an unrecorded CUDA GPU"), None


def profile_from_gpu_check(data: dict, where: str = "gpu_check.json", date: str = "", drafter: str = "standalone") -> CostProfile:
    """A **measured** GPU profile from ``python scripts/gpu_check.py`` output, named after the GPU it ran on
    (e.g. "NVIDIA H100 80GB HBM3 (measured, gpu_check 2026-12-06)"). ``drafter``: whose draft and packed pass price the
    D3D modes ("standalone": the Qwen3-1.7B-shaped drafter; "adapter": the shared-weight one). ValueError, one sentence
    naming ``where``, for a dry run, a CPU run, or a file without the cost table."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not a gpu_check result (a JSON object expected)")
    gpu, refused = gpu_of(data)
    if refused:
        raise ValueError(f"{where} is not offered as a GPU profile: {refused}")
    costs = data.get("costs")
    if not isinstance(costs, dict) or not costs.get("verify_ms"):
        failed = [f.get("step") for f in data.get("failed_steps") or [] if isinstance(f, dict)]
        why = f" (failed steps: {', '.join(map(str, failed))})" if failed else ""
        raise ValueError(f"{where} has no cost table (costs.verify_ms): the check stopped before measuring costs{why}")
    try:
        verify = {int(k): float(v) for k, v in costs["verify_ms"].items()}
        step = float(costs.get("step_ms") or verify[1])
        B = int(costs.get("B", 8))
        d = (costs.get("drafters") or {})[drafter]
        draft = float(d["draft_ms"])
        packed = {int(k): float(v) for k, v in d["packed_ms"].items()}
        conc = {int(h): c for h, c in (d.get("concurrent_ms") or {}).items() if isinstance(c, dict) and "verify" in c and "packed" in c}
        contention_ = {h: {"verify": max(1.0, float(c["verify"]) / verify[B]), "packed": max(1.0, float(c["packed"]) / packed[h])}
                       for h, c in conc.items() if B in verify and h in packed}
        shapes = data.get("shapes") or {}
        if shapes.get("target") and shapes.get("vocab"):
            dflash, dflash_how = _dflash_estimate(step, shapes)
        else:
            dflash, dflash_how = draft, "the DFlash draft is not timed by the check and the file has no shapes: the D3D draft stands in"
        t = shapes.get("target") or {}
        sd = shapes.get("standalone_drafter") or {}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where} is a malformed gpu_check result: {type(e).__name__} {e} in its cost table") from None
    v = data.get("versions") if isinstance(data.get("versions"), dict) else {}
    date = str(data.get("created_utc") or "")[:10] or date or "undated"
    short = "" if data.get("done") else "; the run was cut short (no 'done'): only what it measured is used"
    shape = (f"a random-weight target of {t.get('num_hidden_layers', '?')} layers, hidden {t.get('hidden_size', '?')} "
             f"(Qwen3-8B's shape on the GPU check) in {data.get('dtype', '?')}")
    who = (f"the standalone D3D drafter ({sd.get('num_hidden_layers', '?')} layers, hidden {sd.get('hidden_size', '?')})"
           if drafter == "standalone" else f"the {drafter} D3D drafter")
    return CostProfile(
        name=f"{gpu} (measured, gpu_check {date})",
        source=(f"measured: python scripts/gpu_check.py on {gpu} (torch {v.get('torch', '?')}, CUDA {v.get('cuda', '?')}), "
                f"{where}; CUDA-synchronised medians of {costs.get('repeats', '?')} forwards"),
        assumptions=(f"{shape}, {costs.get('ctx_len', '?')}-token context; D3D modes priced with {who}, whose draft was timed at "
                     f"B = {B} and stands for every B; lane contention from verify(B) ‖ packed(H) on two CUDA streams (events); "
                     f"{dflash_how}{short}"),
        t_step_ms=step, t_verify_ms=verify,
        t_draft_d3d_ms={b: draft for b in sorted({2, 4, 8, 16, B})}, t_draft_dflash_ms={b: dflash for b in sorted({2, 4, 8, 16, B})},
        t_packed_ms=packed, packed_block=B, measured=True,
        extra={"gpu": gpu, "gpu_check": where, "drafter": d.get("describe", drafter), "contention": contention_,
               "async_beats_seq": data.get("async_beats_seq") or []},
    )


def load_gpu_check(path, drafter: str = "standalone") -> CostProfile:
    """:func:`profile_from_gpu_check` of a JSON file; ValueError, one sentence, when it cannot be read or used."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path.name}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path.name} is not valid JSON ({e})") from None
    try:
        date = time.strftime("%Y-%m-%d", time.gmtime(path.stat().st_mtime))
    except OSError:
        date = ""
    return profile_from_gpu_check(data, where=path.name, date=date, drafter=drafter)


def measured_gpu_profiles(folder=None) -> tuple:
    """({name: measured GPU profile}, [why a file was not offered]) for every ``*.json`` under ``folder``
    (default ``docs/gpu/``): each GPU check's JSON becomes a profile; a dry run, a CPU run or a malformed file is
    left out with one sentence, never a traceback."""
    folder = Path(folder) if folder is not None else GPU_DOCS
    out, notes = {}, []
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            p = load_gpu_check(f)
        except ValueError as e:
            notes.append(str(e))
            continue
        if p.name in out:  # two checks on the same GPU on the same day: the file tells them apart
            p = replace(p, name=f"{p.name[:-1]}, {f.stem})")
        out[p.name] = p
    return out, notes


GPU_MEASURED, GPU_PROFILE_NOTES = measured_gpu_profiles()


def _shipped_cpu_profile() -> dict:
    """The bundled model's measured CPU profile, read from the shipped cost breakdown (so refreshing
    that file refreshes the preset); empty when the file is absent."""
    p = profile_from_breakdown(asset_json("bench", "smollm2-135m-costs.json") or {})
    return {p.name: p} if p else {}


PRESETS = {
    **_shipped_cpu_profile(),
    **GPU_MEASURED,  # measured on a GPU (docs/gpu/*.json), offered before the assumed ones
    "qwen3-8b on H200 (derived)": _gpu_profile("qwen3-8b on H200 (derived)", 8.2, 36, 4096, 151936, 4.8, 0.8),
    # the bundled 135M target on a GPU: weights are read in ~0.06 ms, so launch overhead dominates
    "smollm2-135m on H200 (derived)": _gpu_profile("smollm2-135m on H200 (derived)", 0.135, 30, 576, 49152, 4.8, 1.5),
    "qwen3-8b on H100 (derived)": _gpu_profile("qwen3-8b on H100 (derived)", 8.2, 36, 4096, 151936, 3.35, 0.8),
    "qwen3-32b on H200 (derived)": _gpu_profile("qwen3-32b on H200 (derived)", 32.8, 64, 5120, 151936, 4.8, 1.2),
}


MODELLED = ("dflash", "d3d-seq", "d3d-async")  # the drafting modes the model prices (ar is the yardstick)


def _modelled(s: dict) -> bool:
    """A summary row the model can price: a drafting mode with a measured speedup and a positive τ.
    Peers (no τ: ``generate`` hides its rounds) and a mode that ran no round (τ 0) are left out."""
    return s.get("mode") in MODELLED and s.get("speedup") is not None and (s.get("tau") or 0) > 0


def _error(pred: float, measured: float) -> Optional[float]:
    return (pred - measured) / measured if measured else None


def validate(result: dict, profile: Optional[CostProfile] = None) -> list:
    """Predicted vs measured speedup per dataset x mode of a bench result (JSON dict with
    'summary', 'rows', 'costs'), using its measured τ and hit rate. Returns rows with the error.
    Rows the model cannot price (peers, a mode with no round) are left out."""
    if profile is None:
        if "costs" not in result:
            raise ValueError("the bench result has no cost probe: rerun with --cost-probe")
        profile = profile_from_probe(result["costs"])
    dec = result["config"]["decode"]
    B, H = dec["block_size"], dec["hypotheses"]
    out = []
    for s in result["summary"]:
        if not _modelled(s):
            continue
        p = async_profile(profile) if s["mode"] == "d3d-async" else profile
        pred = p.t_step_ms / per_token_ms(p, s["mode"], B, s["tau"], s.get("hit_rate") or 0.0, H)
        out.append({"dataset": s["dataset"], "mode": s["mode"], "tau": s["tau"], "hit_rate": s.get("hit_rate"),
                    "measured_speedup": s["speedup"], "predicted_speedup": pred, "error": _error(pred, s["speedup"])})
    return out


def mean_span(rows: list, kind: str) -> Optional[float]:
    """Mean ms of one ``kind`` span over bench rows (``span_ms``), weighted by each row's count; None if none."""
    t = sum(r["span_ms"][kind]["mean"] * r["span_ms"][kind]["n"] for r in rows if kind in r.get("span_ms", {}))
    n = sum(r["span_ms"][kind]["n"] for r in rows if kind in r.get("span_ms", {}))
    return t / n if n else None


def validate_in_run(result: dict) -> list:
    """The model's structure checked apart from cost-probe drift: the same formulas, fed with
    the mean span durations this very run paid (bench rows' ``span_ms``) instead of a separate
    probe. A small error here and a larger one in :func:`validate` means the probe, not the
    model, is off. Rows without spans (old results) are skipped."""
    dec = result["config"]["decode"]
    rows = [r for r in result["rows"] if r.get("span_ms") and r.get("block_size", dec["block_size"]) == dec["block_size"]
            and (r["mode"] == "ar" or plan_of(r, dec.get("verify")) == plan_of(dec))]  # the table's plan only

    out = []
    for s in result["summary"]:
        if not _modelled(s) or s["dataset"] == "average":
            continue
        ds = [r for r in rows if r["dataset"] == s["dataset"]]
        step = mean_span([r for r in ds if r["mode"] == "ar"], "verify")
        mine = [r for r in ds if r["mode"] == s["mode"]]
        verify = mean_span(mine, "verify")
        if step is None or (verify is None and mean_span(mine, "step") is None):  # no span of this mode's rounds
            continue
        # every span this mode paid, summed; a round the draft gate skipped paid one step (its "step" span)
        total = lambda kind: sum(r["span_ms"][kind]["mean"] * r["span_ms"][kind]["n"] for r in mine if kind in r["span_ms"])  # noqa: E731
        rounds = sum(r["rounds"] for r in mine)
        n_drafted = rounds - sum(r["span_ms"].get("step", {}).get("n", 0) for r in mine)
        if s["mode"] == "d3d-async":  # verify and the packed pass overlap: the longer one counts
            drafted = n_drafted * max(verify or 0.0, mean_span(mine, "packed_draft") or 0.0) + total("sync_draft") + total("draft")
        else:
            drafted = total("draft") + total("verify")
        rnd = (drafted + total("step")) / max(1, rounds)
        if rnd <= 0:
            continue
        pred = step / (rnd / s["tau"])
        out.append({"dataset": s["dataset"], "mode": s["mode"], "tau": s["tau"], "hit_rate": s.get("hit_rate"),
                    "measured_speedup": s["speedup"], "predicted_speedup": pred, "error": _error(pred, s["speedup"])})
    return out


def project_bench(result: dict, profiles: Optional[dict] = None, B: Optional[int] = None, H: Optional[int] = None) -> list:
    """Model-based speedup of every mode under each cost profile, fed with a bench result's
    measured τ and hit rate (its 'average' rows, or the single dataset's). The profiles model rounds that
    all draft (on a GPU a drafted round always pays, so the draft gate never closes); where the table's
    rows were gated and the run also drafted every round (``--compare-drafting``), those rows' τ and hit
    rate are the ones projected."""
    profiles = profiles or PRESETS
    dec = result["config"]["decode"]
    B, H = B or dec["block_size"], H or dec["hypotheses"]
    rows = [s for s in result["summary"] if s["dataset"] == "average"] or result["summary"]
    always = plan_label((dec.get("verify"), "always"))
    every = {m: v[always] for m, v in (result.get("plan_compare") or {}).items() if always in v}
    rows = [{**s, **{k: every[s["mode"]][k] for k in ("tau", "hit_rate") if k in every.get(s["mode"], {})}} for s in rows]
    out = []
    for name, p in profiles.items():
        for s in rows:
            if s["mode"] not in MODELLED or not (s.get("tau") or 0) > 0:  # ar is the yardstick; peers have no τ to project
                continue
            q = async_profile(p) if (s["mode"] == "d3d-async" and p.measured) else p
            out.append({"profile": name, "mode": s["mode"], "B": B, "H": H, "tau": s["tau"], "hit_rate": s.get("hit_rate"),
                        "projected_speedup": speedup(q, s["mode"], B, s["tau"], s.get("hit_rate") or 0.0, H)})
    return out


def main(argv=None) -> int:
    """python -m d3d_core.measure.latency BENCH.json: project a measured bench onto every cost profile."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m d3d_core.measure.latency", description="Project a bench result's measured τ and hit "
                                 "rate onto every cost profile (model-based, not measured).")
    ap.add_argument("bench", help="a bench JSON (python -m d3d_core.measure.bench --out …)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--hypotheses", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        result = json.loads(open(args.bench).read())
        if not isinstance(result, dict) or "summary" not in result or "config" not in result:
            raise ValueError("not a bench result (no summary / config)")
    except (OSError, ValueError) as e:
        print(f"error: cannot read bench result {args.bench}: {e}", file=sys.stderr)
        return 2
    steps = Steps(raw=args.bench)  # the measurements are the bench file itself; the projection is a summary step
    rows = steps.run("projection", project_bench, result, B=args.block_size, H=args.hypotheses, default=[])
    with steps.step("print"):
        print("MODEL-BASED projection (measured τ / hit rate, cost profiles from latency.PRESETS):")
        print(table_text(rows, cols=["profile", "mode", "B", "H", "tau", "hit_rate", "projected_speedup"]))
        for name, p in PRESETS.items():
            print(f"\n{name}\n  source: {p.source}\n  assumptions: {p.assumptions}")
        for note in GPU_PROFILE_NOTES:
            print(f"\nnot offered: {note}")
    return steps.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
