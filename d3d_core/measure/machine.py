"""Which machine a measurement came from, and whether it was quiet while it ran.

Timings on these machines differ by CPU model (an AVX2 EPYC and an AVX-512 Xeon have given
2× different figures for the same command) and by load (a background job sharing two cores
halves everything). Every bench / cost result therefore carries ``machine_info()`` and a
``Quietness`` record: the load average when it started and the CPU time *other* processes
took while it ran. A run is called noisy when others used more than ``NOISY_CORES`` of a core
on average. The load average is recorded but does not decide: it trails by a minute, so a run
started right after another benchmark (of the same chain) shows that one's load.

A neighbour outside this (virtual) machine is invisible to both: it takes cycles from the host's
cores without showing in /proc/stat (these VMs report no steal time). Measured here: a cost probe
whose other processes used 0.007 cores read step(1) 64 ms against 41 ms quiet. So the run's own
speed is checked too: its AR step against the quiet reference step of the same CPU model (the
shipped cost breakdown); ``SLOW_STEP`` times slower flags it (``Quietness.against``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

NOISY_CORES = 0.10  # other processes' mean CPU use (cores) above which a timing is flagged
SLOW_STEP = 1.25  # a step this many times slower than the quiet reference of the same CPU flags the run


def machine_info() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def git_commit() -> Optional[str]:
    """The short commit of the checkout this code runs from (a "-dirty" mark when tracked files changed), or None
    outside a git checkout: a shipped figure names its date, CPU and commit."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        run = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, timeout=10)  # noqa: E731
        head = run("rev-parse", "--short=7", "HEAD")
        if head.returncode != 0:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU's model name with the vector ISA PyTorch's kernels use, e.g. "AMD EPYC (AVX-512)": machines
    of this project's kind report the same model name with AVX2 or AVX-512, and they time differently."""
    name = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    isa = cpu_isa()
    return f"{name} ({isa})" if isa else name


def cpu_isa() -> str:
    """"AVX-512", "AVX2", ... as ``torch.backends.cpu.get_cpu_capability()`` reports it, or "" when unknown."""
    try:
        import torch

        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        return ""
    return {"AVX512": "AVX-512", "DEFAULT": ""}.get(cap, cap)


def _busy_cpu_s() -> float:
    """CPU seconds all processes have spent busy since boot (Linux /proc/stat), or NaN."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


@dataclass(frozen=True)
class Quietness:
    load_at_start: float  # 1-minute load average before the run
    other_cpu_s: float  # CPU seconds other processes used during the run
    wall_s: float
    other_cores: float  # other_cpu_s / wall_s: mean number of cores others kept busy
    noisy: bool
    warning: str
    step_ms: Optional[float] = None  # this run's AR step (mean), when it has one
    reference_step_ms: Optional[float] = None  # the quiet step of the same CPU it was compared with

    def to_json(self) -> dict:
        return asdict(self)

    def against(self, step_ms: Optional[float], reference: Optional[dict]) -> "Quietness":
        """This record, also judged by the run's own step against ``reference`` (``step_reference``)
        when both exist and the CPU model matches; a step ``SLOW_STEP``× slower marks it noisy."""
        if not step_ms or not reference or reference.get("cpu") != cpu_model():
            return self
        ref = float(reference["step_ms"])
        out = replace(self, step_ms=round(step_ms, 2), reference_step_ms=round(ref, 2))
        if step_ms <= SLOW_STEP * ref:
            return out
        why = (f"one step took {step_ms:.0f} ms against {ref:.0f} ms on a quiet {reference['cpu']} "
               f"({step_ms / ref:.2f}×): something outside this machine was probably sharing its cores")
        msg = ("machine was not quiet: " + why + "; timings and speedups may be off") if not self.noisy else \
            self.warning.replace("; timings", f"; {why}; timings")
        return replace(out, noisy=True, warning=msg)


def step_reference(costs: dict, threads: Optional[int] = None, engine: Optional[str] = None) -> Optional[dict]:
    """{"cpu", "threads", "step_ms"} of a quiet cost breakdown (``python -m d3d_core.measure.costs``)
    at ``threads`` (default: its most), or None (no such row, it was not quiet itself, or it timed another
    ``engine`` than the run being judged: an eager step is slower by design, not by contention)."""
    rows = [r for r in (costs or {}).get("rows", []) if r.get("forward") == "step"]
    if not rows or (costs.get("quiet") or {}).get("noisy", True):
        return None
    if engine is not None and costs.get("engine") != engine:
        return None
    thr = threads or max(r["threads"] for r in rows)
    row = next((r for r in rows if r["threads"] == thr), None)
    cpu = (costs.get("machine_info") or {}).get("cpu")
    return {"cpu": cpu, "threads": thr, "step_ms": float(row["wall_ms"])} if row and cpu else None


class QuietWatch:
    """Measure how quiet the machine stayed: ``w = QuietWatch(); ...; q = w.stop()``."""

    def __init__(self):
        self.load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_cpu_s(), _own_cpu_s()

    def stop(self) -> Quietness:
        wall = time.perf_counter() - self.t0
        other = max(0.0, (_busy_cpu_s() - self.busy0) - (_own_cpu_s() - self.own0))
        cores = other / wall if wall > 0 else 0.0
        why = []
        if cores == cores and cores > NOISY_CORES:  # NaN-safe
            why.append(f"other processes kept {cores:.2f} cores busy on average")
        msg = ("machine was not quiet: " + " and ".join(why) + "; timings and speedups may be off") if why else ""
        return Quietness(round(self.load, 2), round(other, 2), round(wall, 2), round(cores, 3), bool(why), msg)


# ----------------------------------------------------------------------------- a race's machine load
# A race (the app's, ``service.race``) is judged less strictly than a bench run: the Race tab is a demo on a shared
# server whose own UI threads are excluded anyway (same process). Others keeping a quarter of a core busy on average,
# or the hypervisor stealing a twentieth, shifts the modes' times by more than the spread the race itself shows (the
# modes take turns round by round, so a steady load slows them alike, but a busy machine's speed jumps from one round
# to the next), so the app then says the ratios are unreliable. Each mode's load is measured over its own turns.
RACE_BUSY_CORES = 0.25  # other processes' mean CPU use (cores) during a race above which it is flagged busy
RACE_BUSY_STEAL = 0.05  # mean steal time (cores) above which it is flagged busy


def _cpu_times() -> tuple:
    """(busy CPU s excluding steal, steal CPU s) of all processes since boot (Linux /proc/stat), NaN if unreadable."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        tck = os.sysconf("SC_CLK_TCK")
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        steal = vals[7] if len(vals) > 7 else 0
        return (sum(vals[:8]) - idle - steal) / tck, steal / tck
    except (OSError, ValueError, IndexError):
        return float("nan"), float("nan")


def busy_verdict(other_cores: float, steal_cores: float, cores: int) -> tuple:
    """(busy, reason): the classification of a race's machine load (pure, so it can be tested on any numbers).
    ``other_cores``: CPU-seconds other processes used per wall-second; ``steal_cores``: the same for steal time;
    ``cores``: the CPUs the machine has. Busy when either passes its bar (``RACE_BUSY_CORES``, ``RACE_BUSY_STEAL``)."""
    why = []
    if other_cores == other_cores and other_cores > RACE_BUSY_CORES:  # NaN-safe
        why.append(f"other processes used {other_cores:.1f} of {cores} cores during this race")
    if steal_cores == steal_cores and steal_cores > RACE_BUSY_STEAL:
        why.append(f"the hypervisor stole {steal_cores:.2f} cores (steal time)")
    return bool(why), " and ".join(why)


class LoadWatch:
    """The machine's load while one mode of a race runs: ``w = LoadWatch(); ...; d = w.stop()`` gives the fields of
    ``trace.MachineLoad`` (a dict), or None where /proc/stat cannot be read (not Linux)."""

    def __init__(self, running: bool = True):
        self.load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        self._sums = [0.0, 0.0, 0.0, 0.0]  # wall, busy, steal, own CPU s over the segments measured so far
        self._at = None
        if running:
            self.resume()

    def resume(self) -> None:
        """Start (again) counting: a race whose modes take turns measures each mode over its own turns only."""
        if self._at is None:
            busy, steal = _cpu_times()
            self._at = (time.perf_counter(), busy, steal, _own_cpu_s())

    def pause(self) -> None:
        if self._at is None:
            return
        busy, steal = _cpu_times()
        now = (time.perf_counter(), busy, steal, _own_cpu_s())
        self._sums = [s + (b - a) for s, a, b in zip(self._sums, self._at, now)]
        self._at = None

    @contextlib.contextmanager
    def counting(self):
        self.resume()
        try:
            yield
        finally:
            self.pause()

    def stop(self) -> Optional[dict]:
        self.pause()
        wall, busy, steal, own = self._sums
        if busy != busy or wall <= 0:
            return None
        other = max(0.0, busy - own)
        steal = max(0.0, steal)
        cores = os.cpu_count() or 1
        is_busy, why = busy_verdict(other / wall, steal / wall, cores)
        return dict(wall_s=round(wall, 3), other_cpu_s=round(other, 3), other_cores=round(other / wall, 3),
                    steal_s=round(steal, 3), cores=cores, load_at_start=round(self.load, 2) if self.load == self.load else 0.0,
                    busy=is_busy, reason=why)
