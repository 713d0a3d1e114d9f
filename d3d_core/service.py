"""What a front end may ask of the engine, in plain data (no model internals leak out).

The app calls only these functions: validated settings, a race of several modes
(streamed as Traces), readable token pieces, trace upload/download, offline τ of a pruned
drafter and the shipped pruning curve / bench sweep.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from .decoding.config import DecodeConfig
from .decoding.engine import iter_decode, mode_threads, warm_up
from .decoding.plan import plan_of
from .decoding.schedule import interleave, token_share
from .decoding.trace import MODES, MachineLoad, Trace, TraceError, traces_from_json, traces_to_json
from .decoding.warm import warm_rows, warm_shapes
from .limits import APP_ENGINE_DEFAULT, APP_ENGINES, APP_LIMITS, LIVE_TAU_LAYERS
from .measure.clock import retime_all
from .measure.latency import GPU_PROFILE_NOTES, PRESETS, async_profile, mean_span, per_token_ms
from .measure.machine import LoadWatch, cpu_model
from .models import bundles as _bundles
from .models import int4
from .models.adapter import SHARED_ADAPTER_INFO
from .models.bundles import BUNDLES, DEFAULT_BUNDLE, asset_json, extra_d3d_drafters, get_bundle, loadable_bundles
from .models.drafter import DrafterConfig
from .schemas import AppSettings, checked
from .training import offline_tau as _offline_tau
from .training.offline_tau import anchors_for, calibration_set, offline_tau


def settings(mode="d3d-async", block_size=8, temperature=0.0, max_new_tokens=128, hypotheses=4,
             sampling="match", seed=0, verify="adaptive", drafting="gated") -> DecodeConfig:
    """Build a DecodeConfig from loosely typed UI values (``schemas.AppSettings``); ValueError with a readable message."""
    return AppSettings.parse(mode=mode, block_size=block_size, temperature=temperature, max_new_tokens=max_new_tokens,
                             hypotheses=hypotheses, sampling=sampling, seed=seed, verify=verify,
                             drafting=drafting).decode_config()


def check_modes(modes) -> list:
    if isinstance(modes, str):
        modes = [m.strip() for m in modes.split(",") if m.strip()]
    if not modes:
        raise ValueError("pick at least one mode to run")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {', '.join(map(str, bad))}; choose from {', '.join(MODES)}")
    return [m for m in MODES if m in modes]  # canonical order, ar first (the speedup reference)


def check_prompt(prompt) -> str:
    if not isinstance(prompt, str):
        raise ValueError("prompt must be text")
    if len(prompt) > APP_LIMITS["prompt_chars_max"]:
        raise ValueError(f"prompt is too long for the demo: {len(prompt):,} characters (limit {APP_LIMITS['prompt_chars_max']:,})")
    if not prompt.strip():
        raise ValueError("prompt is empty: type a question or pick an example")
    return prompt


def bundle_names() -> list:
    """The bundles this server offers: those its hardware can run (no GPU-only bundle without CUDA), narrowed to
    ``D3D_BUNDLES`` (comma-separated) when set; the real ones first, the toys last."""
    names = loadable_bundles()
    wanted = [b.strip() for b in os.environ.get("D3D_BUNDLES", "").split(",") if b.strip()]
    if wanted:
        names = [b for b in names if b in wanted] or names
    return [b for b in names if not b.startswith("toy")] + [b for b in names if b.startswith("toy")]


def app_bundle() -> str:
    """The bundle the app opens on: ``D3D_BUNDLE`` when this server offers it, else the default one, else the first offered."""
    names = bundle_names()
    for b in (os.environ.get("D3D_BUNDLE", "").strip(), DEFAULT_BUNDLE):
        if b in names:
            return b
    return names[0]


def check_bundle(name) -> str:
    """``name`` when this server offers that bundle, else ValueError with the reason (a GPU-only bundle on a CPU host
    is named as such). Loads nothing."""
    names = bundle_names()
    if isinstance(name, str) and name in names:
        return name
    if isinstance(name, str) and name in BUNDLES and name not in loadable_bundles():
        raise ValueError(f"bundle {name!r} runs on a CUDA GPU only and this server has none; bundles here: {', '.join(names)}")
    raise ValueError(f"unknown bundle {str(name)[:60]!r}; available: {', '.join(names)}")


_STARTUP_ONLY = False  # a ZeroGPU Space: bundles load at start-up, never from a request (see load_at_startup_only)


def load_at_startup_only(on: bool = True) -> None:
    """From now on a bundle that is not loaded yet is refused instead of loaded (a ZeroGPU Space, after its start-up
    preload: a request thread is outside ZeroGPU's CUDA emulation, so a load there would initialise CUDA in the main
    process, which ZeroGPU forbids)."""
    global _STARTUP_ONLY
    _STARTUP_ONLY = bool(on)


def _bundle(name: str):
    """The loaded bundle ``name``: read without a lock once loaded (a GPU worker forked while another thread of the
    server held the loader's lock would wait on it forever), loaded otherwise — or refused where bundles load at
    start-up only."""
    b = getattr(_bundles, "_LOADED", {}).get((name, "cpu")) if isinstance(name, str) else None  # get_bundle's key for the app's bundles; a dict read is atomic
    if b is not None:
        return b
    if _STARTUP_ONLY:
        raise ValueError(f"bundle {str(name)[:60]!r} is not loaded, and this Space loads its bundles at start-up only "
                         "(ZeroGPU: a request may not move weights to the GPU); pick the bundle it opened on")
    return get_bundle(name)


def preload(name: str) -> Optional[str]:
    """Load a bundle now (a GPU Space loads its bundle at start-up, outside any GPU window); the reason as a
    sentence when it cannot be loaded (the app then starts anyway and says so at the first race)."""
    try:
        get_bundle(check_bundle(name))
    except (ValueError, FileNotFoundError, OSError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - at start-up anything (CUDA out of memory, a missing package) must leave the app serving
        return f"{type(e).__name__}: {e}"
    return None


def int4_kernel() -> str:
    """Which GEMM the int4 engine runs here, in words (the low-bit kernel, or torch's with the reason it fell back)."""
    st = int4.kernel_status()
    return st.kernel if st.lowbit else f"{st.kernel}: {st.reason}"


def bundle_summary(name: str) -> dict:
    b = _bundle(name)
    d3d = b.drafter("d3d")
    return {
        "name": b.name,
        "description": b.description,
        "device": str(b.device),
        "attention": b.attention,
        "target_layers": b.target.num_layers,
        "d3d_layers": d3d.cfg.num_layers,
        "d3d_init_layers": list(d3d.cfg.init_layers),
        "d3d_default_skip": list(d3d.cfg.skip_layers),  # a shipped pruned default skips these
        "d3d_active_layers": len(d3d.active_layers()),
        "block_size": default_block(name),
        "engine": b.target.engine,
        "int4_kernel": int4_kernel(),
        "drafters": dict(b.drafter_info),
    }


def d3d_drafters(bundle_name: str) -> dict:
    """The bundle's D3D drafters a race may use: name -> a label for a picker, read from the shipped
    configs (nothing is loaded). "d3d" is the default; further shipped ones (``assets/drafters/<bundle>/d3d-*``,
    e.g. ``d3d-deep``) load on a race's first use."""
    def label(name):
        try:
            return DrafterConfig.from_json(asset_json("drafters", bundle_name, name, "config.json")).describe()
        except (TypeError, ValueError):  # no shipped config (a toy bundle's drafters are built in code), or an unreadable one
            spec = BUNDLES.get(bundle_name)
            d3d = spec.from_environment().drafter("d3d") if spec is not None else None
            if name == "d3d" and d3d is not None and d3d.adapter_rank and not d3d.source:
                return SHARED_ADAPTER_INFO
            return "D3D drafter"

    out = {"d3d": f"default: {label('d3d')}"}
    for name in extra_d3d_drafters(bundle_name):
        out[name] = f"{name}: {label(name)}"
    return out


_WARM: set = set()
_WARM_LOCK = threading.Lock()


def _drafter_cfg(b, name: str) -> DrafterConfig:
    """Drafter ``name``'s config on loaded bundle ``b`` without loading a further drafter (its shipped config says: a
    request thread on ZeroGPU must not load weights)."""
    if name in b.drafters:
        return b.drafters[name].cfg
    path = b.extra.get(name)
    if path is not None:
        return DrafterConfig.from_json(json.loads((Path(path) / "config.json").read_text()))
    return b.drafter(name).cfg


def check_race_drafter(bundle_name: str, d3d_drafter: str = "d3d", skip_layers=None) -> None:
    """ValueError unless the bundle (loaded here if it is not yet) has that D3D drafter and ``skip_layers`` (when
    given) are layers of it, leaving at least one — asked before a race starts, so nothing is refused inside a GPU window."""
    b = _bundle(bundle_name)
    names = b.d3d_names()
    if d3d_drafter not in names:
        raise ValueError(f"bundle {bundle_name!r} has no D3D drafter {str(d3d_drafter)[:40]!r}; it has: {', '.join(names)}")
    if skip_layers is not None:
        n = _drafter_cfg(b, d3d_drafter).num_layers
        bad = [s for s in skip_layers if not isinstance(s, int) or not 0 <= s < n]
        if bad:
            raise ValueError(f"the {d3d_drafter} drafter has layers 0..{n - 1}; cannot skip {bad[:4]}")
        if len(set(skip_layers)) >= n:
            raise ValueError(f"keep at least one of the {d3d_drafter} drafter's layers")


def default_engine() -> str:
    """The Race tab's engine when a visitor picks none: ``$D3D_ENGINE`` when it names one of ``limits.APP_ENGINES``
    (``fast`` reads as fp32; ``eager``, the Hugging Face forward, has no int4: fp32), else ``limits.APP_ENGINE_DEFAULT``."""
    env = os.environ.get("D3D_ENGINE", "").strip().lower()
    return {"fast": "fp32", "fp32": "fp32", "eager": "fp32", "int4": "int4"}.get(env, APP_ENGINE_DEFAULT)  # eager: HF forward, no int4


def check_engine(engine: Optional[str]) -> str:
    engine = (engine or default_engine()).strip().lower()
    if engine not in APP_ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(APP_ENGINES)}")
    return engine


def _no_int4(target) -> Optional[str]:
    """Why ``target`` cannot run the int4 engine here (no fast path at all, or no usable 4-bit weights), or None."""
    return target.fast_reason() or target.int4_reason()


def resolve_engine(bundle_name: str, engine: Optional[str]) -> tuple:
    """(the engine a race of this (loaded) bundle will run on, a note or ""): int4 where the target can run it, else
    fp32 with the reason (a CPU whose int4 kernel fails its self-test, a target without 4-bit weights)."""
    engine = check_engine(engine)
    if engine == "int4":
        why = _no_int4(_bundle(bundle_name).target)
        if why is not None:
            return "fp32", f"int4 is not available here ({why}): racing on fp32"
    return engine, ""


@contextmanager
def on_engine(b, engine: str):
    """Decodes of bundle ``b`` inside the block run on ``engine`` (fp32: the fast engine; int4: the GGUF's 4-bit
    blocks). Races hold the one decode lane, so no other decode of this target runs meanwhile."""
    old = b.target.engine_request
    if old != "eager":  # D3D_ENGINE=eager: the process runs Hugging Face's forward, nothing to choose
        b.target.engine_request = "int4" if engine == "int4" else "fp32"
    try:
        if engine == "int4" and b.target.engine != "int4":
            raise ValueError(f"the int4 engine cannot run bundle {b.name!r}: {_no_int4(b.target) or 'not available here'}; race it on fp32")
        yield
    finally:
        b.target.engine_request = old


def race(bundle_name: str, prompt: str, modes: list, base: DecodeConfig, skip_layers=None, cancel: Optional[threading.Event] = None,
         d3d_drafter: str = "d3d", engine: Optional[str] = None, stats: Optional[dict] = None,
         after_warm: Optional[Callable[[float], None]] = None) -> Iterator[tuple]:
    """``engine``: fp32 or int4 (:func:`check_engine`; None: the app's default); every mode of the race runs on it.
    ``stats``: a dict that receives ``warm_s``, the seconds this race spent warming up (0 when this process had
    already warmed everything it needs), before the first item is yielded. ``after_warm``: called with those
    seconds once the warm-up is done, before the first round (the app starts a race's time limit there: a
    process's first race on an engine must not spend its visitor's time packing weights)."""
    engine = check_engine(engine)
    b = _bundle(bundle_name)
    with on_engine(b, engine):
        yield from _race(b, bundle_name, prompt, modes, base, skip_layers, cancel, d3d_drafter, engine, stats, after_warm)


def warms_shapes(device) -> bool:
    """Whether a race warms every forward shape of each mode (``decoding.warm``) or only runs the bundle's warm-up:
    on a CPU oneDNN builds a kernel per shape and thread count on first use, so each shape is warmed; on a GPU no
    kernel is built per row count and, on ZeroGPU, every warm-up second is paid in each new GPU worker, so only
    the warm-up runs (once per process)."""
    import torch  # noqa: PLC0415  (already imported by the engine; a device type only, CUDA is not touched)

    return torch.device(device).type == "cpu"


def _warm(b, bundle_name: str, engine: str, d3d_drafter: str, d3d, modes: list, base: DecodeConfig) -> float:
    """Warm what this race needs and this process has not warmed yet; the seconds it took. Once everything is warm
    (a second race of the same shape, a reused GPU worker) no lock is taken: a GPU worker forked while a server
    thread held one would wait on it forever."""
    shapes = warms_shapes(b.target.device)
    keys = [(bundle_name, engine)] + ([(bundle_name, d3d_drafter, engine)] if d3d_drafter != "d3d" else [])
    per_mode = {}
    if shapes:
        for m in modes:  # every shape this race's modes will meet (verify widths, drafter rows, thread counts)
            cfg = base.with_(mode=m)
            per_mode[m] = (bundle_name, engine, d3d_drafter if m.startswith("d3d") else None, m, cfg.block_size, cfg.hypotheses,
                           cfg.threads, mode_threads(cfg, b.target.device), warm_rows(cfg))
    if all(k in _WARM for k in keys + list(per_mode.values())):
        return 0.0
    t0 = time.perf_counter()
    with _WARM_LOCK:
        if (bundle_name, engine) not in _WARM:
            warm_up(b)  # the first race of a process (per engine) must not time weight packing
            _WARM.add((bundle_name, engine))
        if (bundle_name, d3d_drafter, engine) not in _WARM and d3d_drafter != "d3d":
            warm_up(b, drafter=d3d)
            _WARM.add((bundle_name, d3d_drafter, engine))
        for m, key in per_mode.items():
            if key not in _WARM:
                warm_shapes(b, base.with_(mode=m), drafter=d3d if m.startswith("d3d") else None)
                _WARM.add(key)
    return time.perf_counter() - t0


def _race(b, bundle_name: str, prompt: str, modes: list, base: DecodeConfig, skip_layers, cancel, d3d_drafter: str,
          engine: str, stats: Optional[dict] = None, after_warm=None) -> Iterator[tuple]:
    """Race the modes on one prompt, streaming ``(mode, trace, done)`` after each mode's prefill and every round.

    The modes take turns, one round at a time, the turn going to the mode furthest behind in committed tokens
    (``decoding.schedule``): all columns grow together, and any drift of the machine's speed is spread over every
    mode instead of landing on whichever ran then. Each mode's times are its own (its clock stops while the others
    take their turns, and while the caller renders what it was given), and each turn ends quiescent (d3d-async's
    drafter thread has nothing in flight), so no mode runs, or is timed, during another's turn. Before the first
    race of a configuration every forward shape each mode will use is warmed, at that mode's thread counts
    (``decoding.warm``), so no mode pays a first use another does not; on a GPU only the bundle's warm-up runs,
    once per process (:func:`warms_shapes`). Each finished trace carries the machine's load
    over its own turns (``load``). A cancel ends every mode within a round (finish "cancelled").

    ``d3d_drafter``: which of the bundle's D3D drafters (``d3d_drafters``) the D3D modes use. ``skip_layers``: None
    races that drafter as shipped (the default may be a shipped pruned one); a list races it with exactly those
    layers skipped (the default drafter only)."""
    check_race_drafter(bundle_name, d3d_drafter, skip_layers)
    modes = check_modes(modes)
    d3d = b.drafter(d3d_drafter)
    warm_s = _warm(b, bundle_name, engine, d3d_drafter, d3d, modes, base)
    if stats is not None:
        stats["warm_s"] = warm_s
    if after_warm is not None:
        after_warm(warm_s)
    if skip_layers is not None:
        d3d = d3d.pruned(skip_layers)
    if cancel is not None and cancel.is_set():
        return
    steps = {m: iter_decode(b, prompt, base.with_(mode=m), cancel=cancel, drafter=d3d if m.startswith("d3d") else None)
             for m in modes}
    watch = {m: LoadWatch(running=False) for m in modes}  # the machine's load over each mode's own turns (``Trace.load``)
    try:
        for m, tr, done in interleave(steps, token_share(base.max_new_tokens), around=lambda m: watch[m].counting()):
            if done and tr is not None:
                load = watch[m].stop()
                tr.load = MachineLoad(**load) if load else None
            yield m, tr, done
    finally:
        for g in steps.values():
            g.close()


def pieces(bundle_name: str, traces: list, known: Optional[dict] = None) -> dict:
    """Readable text of every token id that appears in the traces and is not in ``known``
    (a streaming UI passes what it already has, so each id is decoded once per run)."""
    b = _bundle(bundle_name)
    ids = set()
    for t in traces:
        if t is None:
            continue
        ids.update(t.output_ids)
        if t.first_token is not None:
            ids.add(t.first_token)
        for r in t.rounds:
            ids.update(r.draft_ids)
            ids.update(r.target_ids)
            ids.add(r.anchor_id)
            ids.add(r.bonus)
            for h in r.hypotheses:
                ids.add(h.token)
                ids.update(h.draft_ids)
    V = b.target.arch.vocab_size
    known = known or {}
    ids = sorted(i for i in ids if 0 <= i < V and i not in known)
    return dict(zip(ids, b.tokenizer.token_strings(ids)))


def traces_json(traces: list) -> str:
    return traces_to_json([t for t in traces if t is not None], indent=1)


def read_traces(data) -> list:
    """Parse an uploaded file's bytes/text; TraceError (a ValueError) with a readable message."""
    return traces_from_json(data)


RACES_DIR = _bundles.ASSETS / "races"  # the class demo's recorded races (scripts/record_race.py)


def recorded_race(bundle_name: str, preset: str = "lesson") -> Optional[tuple]:
    """The race recorded for the class demo (``scripts/record_race.py --out assets/races/<bundle>-<preset>.json``):
    (its Traces, where and when it ran: ``recorded``), or None when this bundle ships none. A shipped file that no
    longer reads (an older trace version) is a ValueError with the reason, said to the visitor."""
    p = RACES_DIR / f"{bundle_name}-{preset}.json"
    if not p.is_file():
        return None
    data = p.read_bytes()
    trs = read_traces(data)
    meta = json.loads(data).get("recorded") or {}
    return trs, meta if isinstance(meta, dict) else {}


def _asset_json(*parts, schema: Optional[str] = None) -> Optional[dict]:
    """A JSON file shipped under assets/, or None when absent or unreadable; checked against
    ``schemas.SCHEMAS[schema]`` when given (a shipped file that does not fit is an error, said at once)."""
    d = asset_json(*parts)
    return checked(schema, d) if schema and d is not None else d


def pruning_curve(bundle_name: str, drafter: str = "d3d") -> Optional[dict]:
    """The precomputed progressive-pruning curve of one of the bundle's D3D drafters (``python -m
    d3d_core.training.prune [--drafter NAME]``), if shipped: ``assets/pruning/<bundle>.json`` for the default,
    ``<bundle>-<name>.json`` for another (d3d-deep)."""
    return _asset_json("pruning", f"{bundle_name}.json" if drafter == "d3d" else f"{bundle_name}-{drafter}.json",
                       schema="pruning curve")


def block_sweep_result(bundle_name: str) -> Optional[dict]:
    """The shipped block-size sweep's whole bench result (its machine, settings and note), if any."""
    return _asset_json("bench", f"{bundle_name}-block-sweep.json", schema="bench result")


def block_sweep(bundle_name: str) -> Optional[dict]:
    """{mode: {B: {tau, speedup}}} from a shipped block-size sweep, if any."""
    d = block_sweep_result(bundle_name)
    return d.get("sweep") if d else None


def measured_point(bundle_name: str) -> tuple:
    """(τ, hit rate, B) of d3d-async on gsm8k in the shipped bench — where the projection sliders
    start, so a projection begins from what this bundle's drafter really achieves. The projection models
    rounds that all draft, so where the bench also drafted every round (``--compare-drafting``) those
    rows give the figures; a gated table's τ counts undrafted rounds as 1."""
    return _measured_point(bundle_name)[:3]


def measured_point_and_source(bundle_name: str) -> tuple:
    """(τ, hit rate, B, where): ``measured_point`` and where it took its figures, in words for the slider it starts
    (one read of the bench for both)."""
    return _measured_point(bundle_name)


def _measured_point(bundle_name: str) -> tuple:
    res = bench_result(bundle_name) or {}
    dec = (res.get("config") or {}).get("decode") or {}
    row = next((s for s in res.get("summary") or [] if s.get("mode") == "d3d-async" and s.get("dataset") == "gsm8k"), None)
    every = [r for r in res.get("rows") or [] if r.get("mode") == "d3d-async" and r.get("dataset") == "gsm8k"
             and r.get("block_size") == dec.get("block_size") and plan_of(r) == (dec.get("verify"), "always") and r.get("rounds")]
    where = "the Measured bench's d3d-async on gsm8k (its table's row)"
    if every:
        hits = [r["hit_rate"] for r in every if r.get("hit_rate") is not None]
        gated = f", {row['hit_rate']:.3f}" if row and row.get("hit_rate") is not None else ""  # as the table prints it
        row = {"tau": sum(r["tau"] * r["rounds"] for r in every) / sum(r["rounds"] for r in every),
               "hit_rate": sum(hits) / len(hits) if hits else 0.0}
        where = (f"the Measured bench's d3d-async on gsm8k drafting every round, the mean over its {len(hits)} prompts: "
                 f"per-prompt rows of assets/bench/{bundle_name}.json, not a row of the Measured table (its gsm8k row is the "
                 f"{dec.get('drafting') or 'main'} run{gated}; its 'drafting always' rows average the datasets) — the projection models rounds that all draft")
    B = int(dec.get("block_size") or 8)
    if not row:
        return 2.0, 0.3, B, "assumed: no bench of d3d-async on gsm8k ships with this bundle"
    return round(float(row["tau"]), 2), round(float(row.get("hit_rate") or 0.0), 2), B, where


def block_sweep_stale(bundle_name: str) -> bool:
    """Whether the shipped block-size sweep was made with drafters replaced since (its note says so)."""
    return "replaced since" in str((block_sweep_result(bundle_name) or {}).get("note") or "")


def block_sweep_datasets(bundle_name: str) -> str:
    """Which datasets the shipped block-size sweep ran on (for its title)."""
    d = _asset_json("bench", f"{bundle_name}-block-sweep.json") or {}
    ds = (d.get("config") or {}).get("datasets") or ""
    return ds if isinstance(ds, str) else ", ".join(ds)


def bench_result(bundle_name: str) -> Optional[dict]:
    """The measured bench table shipped for the bundle (assets/bench/<bundle>.json), if any."""
    return _asset_json("bench", f"{bundle_name}.json", schema="bench result")


def deep_benches(bundle_name: str) -> list:
    """The shipped benches of the deep D3D drafter, whole and pruned (``bench --d3d-drafter d3d-deep [--skip-layers
    L,...]``, saved as ``assets/bench/<bundle>-d3d-deep*.json``), each a bench result; the whole drafter first, then by
    layers removed."""
    out = []
    for f in sorted((_bundles.ASSETS / "bench").glob(f"{bundle_name}-d3d-deep*.json")):
        d = _asset_json("bench", f.name, schema="bench result")
        if d:
            out.append(d)
    return sorted(out, key=lambda d: len(skipped_layers(d)))


def skipped_layers(result: dict) -> list:
    """The drafter layers a bench result skipped (its ``--skip-layers``), as ints."""
    s = str(((result or {}).get("config") or {}).get("skip_layers") or "")
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def default_block(bundle_name: str) -> int:
    """The app's default block size for a bundle (without loading it)."""
    return BUNDLES[bundle_name].block_size if bundle_name in BUNDLES else 8


MEASURED_CLOCK = "measured here"


def clock_names() -> list:
    """The Timeline's clocks: the run as measured, or re-timed under a latency-model profile — the GPU ones, measured
    (``scripts/gpu_check.py``, docs/gpu/) before assumed; not the measured CPU profile, which "measured here" already is."""

    return [MEASURED_CLOCK] + [n for n, p in PRESETS.items() if not p.measured or p.extra.get("gpu")]


def retimed(traces: list, clock: str) -> tuple:
    """(traces, projected profile name or None) for the chosen clock; ValueError for an unknown one."""

    if clock in (None, "", MEASURED_CLOCK):
        return traces, None
    if clock not in PRESETS:
        raise ValueError(f"unknown clock {clock!r}; choose one of {', '.join(clock_names())}")
    return retime_all(traces, PRESETS[clock]), clock


def clock_assumptions(clock: str) -> str:
    if clock in (None, "", MEASURED_CLOCK):
        return "Span lengths as measured during the run, on the machine that ran it (a recorded race: the machine the Status line names), on one clock for both lanes." + gpu_profile_note()
    p = PRESETS.get(clock)
    if p is None:
        return ""
    return (f"**Projected** under “{p.name}”. Source: {p.source}. Assumptions: {p.assumptions}. "
            f"T_step = {p.t_step_ms:.2f} ms, T_verify(8) = {p.at(p.t_verify_ms, 8):.2f} ms, "
            f"T_draft D3D(8) = {p.at(p.t_draft_d3d_ms, 8):.2f} ms, T_packed(H=4) = {p.at(p.t_packed_ms, 4):.2f} ms. "
            "The rounds, accepted lengths, hits and misses are this run's; only the span lengths change "
            "(sequential: draft then verify; async: the longer of verify and the packed pass, plus a sync draft after a miss).")


def engine_runs(bundle_name: str) -> tuple:
    """(engines run, {engine: bench result}) shipped for the bundle: ``python -m d3d_core.measure.engines``
    (assets/bench/<name>-engines.json: ar on each engine and llama.cpp, one run) and a bench per engine
    (<name>-fp32.json, <name>-int4.json: every mode on that engine, one run each), each None when absent. Without a
    separate fp32 bench, the Measured bench (<name>.json) is the fp32 one when it ran on the fp32 engine: one run, so
    the Measured bench and Engines tabs print the same figures."""
    engines = _asset_json("bench", f"{bundle_name}-engines.json")
    benches = {e: _asset_json("bench", f"{bundle_name}-{n}.json", schema="bench result") for e, n in (("fast", "fp32"), ("int4", "int4"))}
    measured = bench_result(bundle_name) if benches["fast"] is None else None
    eng = (measured or {}).get("engine")
    if measured and (eng.get("target") if isinstance(eng, dict) else eng) == "fast":
        benches["fast"] = measured
    return engines, {e: b for e, b in benches.items() if b}


def cost_breakdown(bundle_name: str, engine: str = "fast") -> Optional[dict]:
    """The shipped cost breakdown (python -m d3d_core.measure.costs) of one engine ("fast": fp32, the one the latency
    model's CPU profile reads; "int4": ``--engine int4``), if any."""
    return _asset_json("bench", f"{bundle_name}-costs{'-int4' if engine == 'int4' else ''}.json")


def run_tag(date, cpu, cores=None, engine=None, commit=None) -> str:
    """A compact tag for figures measured in another run than the one on screen: its date and machine (and engine), the
    commit in its hover text rather than in the sentence (an HTML span the app's CSS styles as ``.d3d-tag``)."""
    where = f"{cores}-core {cpu}" if cores and cpu else (cpu or "an unrecorded CPU")
    text = " · ".join(str(x) for x in (date, where, engine) if x)
    tip = f' title="measured at commit {commit}"' if commit else ""
    return f'<span class="d3d-tag"{tip}>{text}</span>'


def provenance(result: Optional[dict]) -> str:
    """One line saying where and how a shipped measurement was taken (its run's date, machine and engine as a
    ``run_tag``), with the quietness warning."""
    if not result:
        return ""
    m = result.get("machine_info") or result.get("machine") or {}
    eng = result.get("engine")
    eng = eng.get("target") if isinstance(eng, dict) else eng
    eng = {"fast": "fp32"}.get(eng, eng)
    # the date is recorded by runs since 2026-12-07; older files name theirs in a note or in docs/RESULTS.md
    line = "Measured in its own run " + run_tag((m.get("date") or "")[:10] or None, m.get("cpu"), None,
                                                f"{eng} engine" if eng else "engine not recorded", m.get("commit"))
    line += f" ({m.get('torch_threads', '?')} threads)"
    c = result.get("config") or {}
    if c.get("datasets") and c.get("n"):  # the run's settings: two runs of the same quantity differ by these too
        ds = c["datasets"] if isinstance(c["datasets"], str) else ",".join(c["datasets"])
        line += f" · {ds.replace(',', ', ')}, {c['n']} prompts each, {c.get('max_new_tokens', '?')} new tokens"
        if c.get("block_sizes"):
            line += f", B {c['block_sizes'].replace(',', ', ') if isinstance(c['block_sizes'], str) else c['block_sizes']}"
        elif c.get("block_size"):
            line += f", B {c['block_size']}"
        if c.get("verify") and c.get("drafting"):
            line += f", verify {c['verify']}, drafting {c['drafting']}"
    if result.get("note"):  # what the file itself says about its run (e.g. made with drafters since replaced)
        line += f" · ⚠ {result['note']}"
    q = result.get("quiet")
    if not q:
        line += " · ⚠ quietness not recorded (an older measurement: the machine may have been busy)"
    elif q.get("noisy"):
        line += f" · ⚠ {q.get('warning')}"
    else:
        line += f" · quiet machine (others used {q.get('other_cores', 0):.2f} cores on average)"
    return line


def run_prices(result: Optional[dict], mode: str = "d3d-seq", dataset: str = "gsm8k") -> Optional[dict]:
    """What a bench run's machine charged for the parts of a round, read from the run itself: its target's forward over
    8 tokens against one token (the row plan it measured at start-up), and ``mode``'s mean draft and verify ms on
    ``dataset`` (the rows' spans), beside that mode's speedup. None when the run recorded none of it."""
    if not result:
        return None
    eng = result.get("engine")
    fwd = ((eng.get("row_plan") or {}).get("forward_ms") or {}) if isinstance(eng, dict) else {}
    out: dict = {}
    if fwd.get("1") and fwd.get("8"):
        out.update(fwd1_ms=fwd["1"], fwd8_ms=fwd["8"], fwd8_over_1=fwd["8"] / fwd["1"])
    dec = (result.get("config") or {}).get("decode") or {}
    rows = [r for r in result.get("rows") or [] if r.get("mode") == mode and r.get("dataset") == dataset
            and (not dec or plan_of(r, dec.get("verify")) == plan_of(dec))]  # the run's own plan, not a compared one
    for part in ("draft", "verify"):
        if (ms := mean_span(rows, part)) is not None:
            out[f"{part}_ms"] = ms
    row = next((x for x in result.get("summary") or [] if x.get("mode") == mode and x.get("dataset") == dataset), None)
    if row and row.get("speedup"):
        out["speedup"] = row["speedup"]
    return dict(out, mode=mode, dataset=dataset) if out else None


def prices_text(p: Optional[dict]) -> str:
    """One clause from ``run_prices``: "d3d-seq 1.63× on gsm8k; a forward over 8 tokens cost 1.03× one token's
    (41.3 / 39.9 ms), a D3D draft 11.6 ms"."""
    if not p:
        return ""
    bits = []
    if "fwd8_over_1" in p:
        bits.append(f"a forward over 8 tokens cost {p['fwd8_over_1']:.2f}× one token's ({p['fwd8_ms']:.1f} / {p['fwd1_ms']:.1f} ms)")
    if "draft_ms" in p:
        bits.append(f"a {'DFlash' if p['mode'] == 'dflash' else 'D3D'} draft {p['draft_ms']:.1f} ms")
    head = f"{p['mode']} {p['speedup']:.2f}× on {p['dataset']}" if "speedup" in p else ""
    return head + ("; " if head and bits else "") + ", ".join(bits)


def bench_sources(bundle_name: str) -> str:
    """Which machine each Benchmarks section's shipped run came from, beside this one: the sections are separate
    runs, and a quantity two of them measure (ar's tokens/s, a step's ms, τ) differs by machine, run and rules."""

    def cpu(d):
        m = (d or {}).get("machine_info") or (d or {}).get("machine") or {}
        return m.get("cpu") if isinstance(m, dict) else None

    engines, benches = engine_runs(bundle_name)
    runs = [("Measured bench", bench_result(bundle_name)), ("block-size sweep", block_sweep_result(bundle_name)),
            ("Where the time goes", cost_breakdown(bundle_name)), ("Engines (run)", engines),
            ("Engines (bench per engine)", benches.get("fast") or benches.get("int4")), ("int4 step costs", cost_breakdown(bundle_name, "int4"))]
    by_cpu: dict = {}
    for name, d in runs:
        if d is not None:
            by_cpu.setdefault(cpu(d) or "an unrecorded CPU", []).append(name)
    if not by_cpu:
        return ""
    where = "; ".join(f"{', '.join(names)} on **{c}**" for c, names in by_cpu.items())
    why = ""
    measured, fp32 = bench_result(bundle_name), benches.get("fast")
    same = fp32 is measured or (fp32 is not None and fp32 == measured)  # one run feeds both tabs: nothing differs
    if measured and fp32 and not same and (a := run_prices(measured)) and (b := run_prices(fp32)):
        why = (" **Why one mode reads differently in two runs**, from what each run's machine charged for a round: the "
               f"Measured bench's run: {prices_text(a)}; the Engines tab's fp32 bench: {prices_text(b)}. Speculation pays "
               "where a forward over 8 tokens costs little more than one token's and the draft is cheap.")
    return (f"**Where these figures come from.** This server runs on **{cpu_model()}**. The sections are separate shipped runs: "
            f"{where}. A quantity measured in two of them (ar's tokens/s, a step's ms, τ) differs by machine, run and rules; "
            "each section's first line names its run." + why)


def cost_profiles() -> dict:
    """The latency model's profiles, in the order offered: this CPU's (measured), each GPU's measured by
    ``scripts/gpu_check.py`` (docs/gpu/*.json, named after the GPU), then the assumed GPU-scale ones."""
    return dict(PRESETS)


def gpu_profile_note() -> str:
    """Why a GPU check's JSON under docs/gpu/ is not offered as a measured profile (a dry run, a CPU run, a malformed
    file), one sentence each; "" when nothing was refused."""
    return "".join(f" Not offered as a GPU profile: {n}." for n in GPU_PROFILE_NOTES)


def project(profile_name: str, B: int, tau: float, hit_rate: float, H: int, verify_x: float = 1.0, draft_x: float = 1.0,
            packed_x: float = 1.0) -> list:
    """Model-based per-token latency and speedup of each mode under a cost profile."""

    if profile_name not in PRESETS:
        raise ValueError(f"unknown cost profile {profile_name!r}; choose one of {', '.join(PRESETS)}")
    if not (1.0 <= float(tau) <= B):
        raise ValueError(f"τ must lie between 1 and the block size {B}")
    if not 0.0 <= float(hit_rate) <= 1.0:
        raise ValueError("hit rate must lie between 0 and 1")
    p = PRESETS[profile_name].scaled(verify=verify_x, draft=draft_x, packed=packed_x)
    rows = []
    for m in MODES:
        pm = async_profile(p) if m == "d3d-async" else p
        t = per_token_ms(pm, m, B, 1.0 if m == "ar" else float(tau), float(hit_rate), int(H))
        rows.append({"mode": m, "ms_per_token": t, "speedup": p.t_step_ms / t})
    return rows


_FULL_TAU: dict = {}
_TAU_LOCK = threading.Lock()
LIVE_TAU_BLOCK = 8


def _fresh_locks_in_child() -> None:
    """In a process forked from this one (ZeroGPU's GPU worker) only the forking thread exists, so no lock can be
    legitimately held there: a lock another server thread held at the fork would stay held forever. The locks on
    a race's path (loading, warm-up, live τ) start free in the child."""
    global _WARM_LOCK, _TAU_LOCK
    _WARM_LOCK, _TAU_LOCK = threading.Lock(), threading.Lock()
    for mod, names in ((_bundles, ("_LOCK", "_EXTRA_LOCK")), (_offline_tau, ("_CALIB_LOCK",))):
        for name in names:
            if isinstance(getattr(mod, name, None), type(threading.Lock())):
                setattr(mod, name, threading.Lock())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)


def live_calibration(bundle_name: str, drafter: str = "d3d") -> list:
    """The calibration sequences the Pruning tab's live τ measures ``drafter`` on: all of the bundle's for a drafter
    of at most ``limits.LIVE_TAU_LAYERS`` layers, else the first ones, as many as keep the work (layers × sequences)
    that of such a drafter on all of them (d3d-deep, 30 layers: 3 of 12), so a toggle answers in about the same time."""
    b = _bundle(bundle_name)
    seqs = calibration_set(b)
    n = _drafter_cfg(b, drafter).num_layers
    if n <= LIVE_TAU_LAYERS:
        return seqs
    return seqs[: max(2, round(len(seqs) * LIVE_TAU_LAYERS / n))]


def offline_tau_live(bundle_name: str, skip_layers, drafter: str = "d3d") -> tuple:
    """(offline τ with these layers of ``drafter`` skipped, τ with every layer) on its live calibration set
    (``live_calibration``); seconds on a CPU. Raises ValueError for bad layer indices."""
    b = _bundle(bundle_name)
    d = b.drafter(drafter)
    seqs = live_calibration(bundle_name, drafter)
    with _TAU_LOCK:
        if (bundle_name, drafter) not in _FULL_TAU:
            _FULL_TAU[(bundle_name, drafter)] = offline_tau(d.pruned([]), seqs, B=LIVE_TAU_BLOCK, stride=2)
    full = _FULL_TAU[(bundle_name, drafter)]
    tau = offline_tau(d.pruned(skip_layers), seqs, B=LIVE_TAU_BLOCK, stride=2) if skip_layers else full
    return tau, full


def draft_cost_row(bundle_name: str) -> Optional[dict]:
    """The shipped cost breakdown's row for the default D3D drafter's draft at its largest thread count, or None."""
    rows = (cost_breakdown(bundle_name) or {}).get("rows") or []
    th = max((r["threads"] for r in rows), default=None)
    return next((r for r in rows if r["threads"] == th and r["forward"].startswith("d3d draft")), None)


def drafter_layer_ms(bundle_name: str, drafter: str = "d3d") -> Optional[float]:
    """What one layer of the default D3D drafter costs per draft on this machine (ms): from the shipped cost breakdown
    (the draft's wall time less its LM head, over the layers it ran, all threads); None if not shipped, and None for
    another drafter (d3d-deep): its pruning curve times a draft pass outside the decode engine, which is not what a
    race pays, so no per-layer figure is claimed for it."""
    if drafter != "d3d":
        return None
    r = draft_cost_row(bundle_name)
    n = bundle_summary(bundle_name)["d3d_active_layers"] if r else None
    if not r or not n:
        return None
    return (r["wall_ms"] - r["parts"]["lm_head"]["ms"]) / n


def calibration_size(bundle_name: str, drafter: str = "d3d") -> int:
    return sum(len(anchors_for(s, LIVE_TAU_BLOCK, 2)) for s in live_calibration(bundle_name, drafter))


def pruning_layers(bundle_name: str, drafter: str = "d3d") -> list:
    """The Pruning tab's toggles for one D3D drafter: one label per layer, naming the target layer it came from
    (the 8-layer drafter was initialised from some) or shares (d3d-deep's are the target's own)."""
    cfg = _drafter_cfg(_bundle(bundle_name), drafter)
    src = list(cfg.init_layers) or [None] * cfg.num_layers
    if cfg.adapter_rank:
        return [f"L{i} (target layer {s}, shared)" for i, s in enumerate(src)]
    return [f"L{i} (initialised from target layer {s})" if s is not None else f"L{i}" for i, s in enumerate(src)]


def default_skip(bundle_name: str, drafter: str = "d3d") -> list:
    """The layers a shipped drafter already skips (a shipped pruned default)."""
    return list(_drafter_cfg(_bundle(bundle_name), drafter).skip_layers)


__all__ = ["offline_tau_live", "calibration_size", "live_calibration", "pruning_layers", "default_skip", "drafter_layer_ms", "bench_result", "cost_profiles", "gpu_profile_note", "project",
    "APP_LIMITS", "DEFAULT_BUNDLE", "MODES", "Trace", "TraceError", "settings", "check_modes", "check_prompt",
    "bundle_names", "app_bundle", "check_bundle", "preload", "default_engine", "check_engine", "resolve_engine", "engine_runs",
    "check_race_drafter", "bundle_summary", "race", "pieces", "load_at_startup_only", "warms_shapes", "traces_json", "read_traces", "pruning_curve", "block_sweep",
]
