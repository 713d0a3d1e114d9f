"""Server health for whoever hosts the app: uptime, races served, queue length, memory, threads,
open files and the app's temporary files. ``snapshot()`` is what the ``/health`` API endpoint returns
and what the page footer shows; the soak command (``python -m d3d_core.measure.soak``) polls it.

Temporary files the app writes for visitors (trace downloads, race exports) live in one directory
per process, ``temp_path()``; files older than ``limits.APP_TEMP_MAX_AGE_S`` are removed whenever a
new one is written, so their number stays bounded however long the server runs."""

from __future__ import annotations

import ctypes
import os
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from d3d_core.limits import APP_TEMP_MAX_AGE_S

STARTED = time.time()
_LOCK = threading.Lock()
_COUNTS = {"races": 0, "stopped": 0, "failed": 0}
_TEMP: Optional[Path] = None


def count(what: str) -> None:
    with _LOCK:
        _COUNTS[what] = _COUNTS.get(what, 0) + 1


def temp_dir() -> Path:
    global _TEMP
    with _LOCK:
        if _TEMP is None or not _TEMP.is_dir():
            _TEMP = Path(tempfile.mkdtemp(prefix="d3d-studio-"))
        return _TEMP


def gradio_temp_dir() -> Path:
    """Where Gradio stores uploads and served files (GRADIO_TEMP_DIR, as Gradio itself resolves it)."""
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio")


OWN_PREFIXES = ("d3d-traces-", "d3d-race-")  # the files temp_path() makes (downloads, exports), and Gradio's copies of them


def sweep() -> int:
    """Remove temp files past ``APP_TEMP_MAX_AGE_S``: the app's downloads and exports, Gradio's served copies of them
    (``<gradio temp>/<hash>/d3d-…``), and the stray ``tmp*`` files an upload leaves at the top of Gradio's temp
    directory (one per upload, beside the hashed copy that Gradio's own ``delete_cache`` removes). Gradio's
    ``delete_cache`` should remove the served copies too, but in one 400-race soak of ten (2026-12-07, a loaded AMD
    EPYC) it stopped after about 230 s and 68 copies up to 540 s old were left: so the app removes its own, by name,
    never another app's files. Returns how many went."""
    now, gone, g = time.time(), 0, gradio_temp_dir()
    stray, copies = [], []
    if g.is_dir():
        for f in g.iterdir():
            try:
                if f.is_file() and f.name.startswith("tmp"):
                    stray.append(f)
                elif f.is_dir():
                    copies += [c for c in f.iterdir() if c.name.startswith(OWN_PREFIXES) and c.is_file()]
            except OSError:
                pass  # removed meanwhile
    for f in list(temp_dir().iterdir()) + stray + copies:
        try:
            if now - f.stat().st_mtime > APP_TEMP_MAX_AGE_S:
                f.unlink()
                gone += 1
                if f.parent != g and f.parent.parent == g and not any(f.parent.iterdir()):
                    f.parent.rmdir()  # the hash directory Gradio made for this copy, now empty
        except OSError:
            pass  # another request removed it first
    return gone


def temp_path(prefix: str, suffix: str) -> str:
    """A fresh file path in the app's temp directory; files past their age are removed first."""
    d = temp_dir()
    sweep()
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=d)
    os.close(fd)
    return path


def _temp_usage() -> tuple:
    d = _TEMP
    if d is None or not d.is_dir():
        return 0, 0
    n = size = 0
    for f in d.iterdir():
        try:
            st = f.stat()
        except OSError:  # swept (or replaced) between the listing and the stat: a visitor's export, not an error
            continue
        if stat.S_ISREG(st.st_mode):
            n += 1
            size += st.st_size
    return n, size


def queue_length(demo) -> Optional[int]:
    """Events waiting in the Gradio queue (None when the queue is not started)."""
    q = getattr(demo, "_queue", None)
    try:
        return len(q) if q is not None else None
    except TypeError:
        return None


def snapshot(demo=None) -> dict:
    import psutil

    p = psutil.Process()
    with p.oneshot():
        rss = p.memory_info().rss
        threads = p.num_threads()
        fds = p.num_fds() if hasattr(p, "num_fds") else None
    n_tmp, tmp_bytes = _temp_usage()
    with _LOCK:
        counts = dict(_COUNTS)
    heap = heap_info()
    return {
        "status": "ok", "uptime_s": round(time.time() - STARTED, 1), "races_served": counts["races"],
        "races_stopped": counts["stopped"], "races_failed": counts["failed"],
        "queue_length": queue_length(demo) if demo is not None else None,
        "queue_max": getattr(getattr(demo, "_queue", None), "max_size", None) if demo is not None else None,
        "rss_mib": round(rss / 2**20, 1), "threads": threads, "open_fds": fds,
        "temp_files": n_tmp, "temp_bytes": tmp_bytes, "pid": os.getpid(),
        "heap_in_use_mib": heap.get("in_use_mib"), "heap_free_mib": heap.get("free_mib"), "heap_mmap_mib": heap.get("mmap_mib"),
        "py_threads": py_threads(), "thread_census": thread_census(demo), "fds_by_kind": fd_census(),
        "memory_census": _memory_census_cached() if os.environ.get("D3D_MEMORY_CENSUS") == "1" else None,
    }


def _dur(s: float) -> str:
    s = int(s)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return f"{d} d {h} h" if d else (f"{h} h {m} min" if h else f"{m} min {s % 60} s")


def line(snap: dict) -> str:
    """The footer's one line."""
    q = snap.get("queue_length")
    queue = f"{q} waiting (max {snap.get('queue_max')})" if q is not None else "not started"
    return (f"Server health · up {_dur(snap['uptime_s'])} · {snap['races_served']} live races served "
            f"({snap['races_stopped']} stopped) · queue: {queue} · memory {snap['rss_mib']:.0f} MiB · "
            f"{snap['threads']} threads · API: `/health`")


# ----------------------------------------------------------------------------- memory

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False  # not glibc (macOS, musl without these): nothing to tune
    return _LIBC


def tune_malloc() -> bool:
    """Make freed memory go back to the OS in a long-running server (glibc only; a no-op elsewhere).

    The soak found the server's RSS creeping by ~0.5 MiB per trace upload and per race with no
    Python object left behind: big short-lived buffers (trace JSON, figures, activations) served
    from glibc's heap, whose mmap threshold rises after each large free, fragmenting per-thread
    arenas that are never returned. A fixed mmap threshold (buffers ≥ 256 KiB are mmapped and
    unmapped on free), two arenas and a trim after each race keep RSS flat."""
    lib = _libc()
    if not lib:
        return False
    lib.mallopt(M_MMAP_THRESHOLD, 256 * 1024)
    lib.mallopt(M_TRIM_THRESHOLD, 1024 * 1024)
    lib.mallopt(M_ARENA_MAX, 2)
    return True


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_info() -> dict:
    """glibc's heap, from ``mallinfo2``: bytes the program holds (in use, mmapped chunks included) against
    bytes free inside the heap. A leak grows ``in_use``; fragmentation grows ``free`` with ``in_use`` flat.
    {} where ``mallinfo2`` is missing (not glibc, or glibc < 2.33)."""
    lib = _libc()
    fn = getattr(lib, "mallinfo2", None) if lib else None
    if fn is None:
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    mib = 2**20
    return {"in_use_mib": round((m.uordblks + m.hblkhd) / mib, 2), "free_mib": round(m.fordblks / mib, 2), "mmap_mib": round(m.hblkhd / mib, 2)}


def py_threads() -> dict:
    """Python threads by name prefix (``AnyIO worker thread``: 3, ...): which pool grew when the thread count does."""
    out: dict = {}
    for t in threading.enumerate():
        key = t.name.split(" (")[0].rstrip("0123456789-_ ") or "thread"
        out[key] = out.get(key, 0) + 1
    return out


# ----------------------------------------------------------------------------- every thread and fd, by pool and kind
#
# A soak judges threads and file descriptors exactly, not by a trend: every thread of the process belongs to a named
# pool with a configured maximum, and every fd to a kind with a bound. A leak is then a thread outside every pool, a
# pool above its maximum or a kind above its bound, at any sample; a pool that wanders within its maximum is no leak.

def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_pools(demo=None) -> dict:
    """Each named pool of Python threads and its maximum (``THREAD_POOLS`` resolved for this process)."""
    workers = getattr(demo, "max_threads", None) or 40  # Gradio's AnyIO limiter: ``launch(max_threads=40)``
    return {name: (workers if limit == "gradio_workers" else min(32, _cores() + 4) if limit == "asyncio_default" else limit)
            for name, (_, limit, _) in THREAD_POOLS.items()}


# pool -> (how its threads are recognised: a name prefix, or a target's module; its maximum; why that maximum)
THREAD_POOLS = {
    "main": ("MainThread", 1, "the interpreter's main thread"),
    "gradio-server": ("module:uvicorn", 1, "uvicorn's Server.run, started in a thread by demo.launch()"),
    "gradio-workers": ("AnyIO worker thread", "gradio_workers", "Gradio runs sync handlers on AnyIO's pool, capped by launch(max_threads)"),
    "asyncio-executor": ("asyncio_", "asyncio_default", "the event loop's default executor: min(32, cores + 4)"),
    "drafter-lane": ("d3d-drafter", 1, "d3d-async's drafter lane: one worker, one decode at a time (the decode lane's concurrency 1)"),
    "probe-lane": ("d3d-probe-lane", 1, "the cost probe's second lane (measure.costs)"),
}


def _pool_of(t: threading.Thread) -> Optional[str]:
    target = getattr(t, "_target", None)  # CPython keeps a running thread's target until run() returns
    module = getattr(target, "__module__", "") or ""
    for name, (match, _, _) in THREAD_POOLS.items():
        if match.startswith("module:"):
            if module.startswith(match[len("module:"):]):
                return name
        elif t.name == match or t.name.startswith(match):
            return name
    return None


def thread_census(demo=None) -> dict:
    """Every thread of this process: Python threads by pool (``pools``), those outside every pool by name
    (``unknown``), and the native threads no Python thread accounts for (``native``: OpenMP teams of torch's
    kernels, one team of ``cores - 1`` workers per Python thread that ran a parallel kernel, and torch's inter-op
    pool of ``cores``), with ``native_max`` the most those can be."""
    pools: dict = {}
    unknown: list = []
    py_ids = set()
    for t in threading.enumerate():
        py_ids.add(t.native_id)
        pool = _pool_of(t)
        if pool is None:
            unknown.append(t.name)
        else:
            pools[pool] = pools.get(pool, 0) + 1
    try:
        tids = {int(x) for x in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: no native census
        tids = None
    native = None if tids is None else len(tids - py_ids)
    n_py = len(py_ids)
    cores = _cores()
    return {"pools": pools, "unknown": sorted(unknown), "native": native, "native_max": n_py * (cores - 1) + cores,
            "pool_max": thread_pools(demo)}


def _unlisted_socket_kind(fd: int) -> str:
    """A socket fd the connection table did not list (it was made, or connected, between that read and the fd scan, or
    is not connected yet): a stream socket of IPv4/IPv6 is a TCP connection being opened ("tcp-open": a client's or
    an accepted one, within the clients' bound), anything else (a datagram socket of a name lookup, a netlink one) is
    "socket-other". The socket type is read from the fd itself, without closing or changing it."""
    if socket.getdefaulttimeout() is not None:  # then wrapping the fd would make its owner's socket non-blocking
        return "socket-other"
    try:
        s = socket.socket(fileno=fd)  # reads the family and type with getsockopt; no dup, flags untouched
    except OSError:  # closed meanwhile
        return "socket-other"
    try:
        inet = s.family in (socket.AF_INET, getattr(socket, "AF_INET6", -1))
        return "tcp-open" if inet and s.type == socket.SOCK_STREAM else "socket-other"
    finally:
        s.detach()  # the fd stays open and belongs to its owner


def _fd_kind(link: str, sock: Optional[str], fd: int) -> str:
    if link.startswith("socket:"):
        return sock or _unlisted_socket_kind(fd)
    if link.startswith("pipe:"):
        return "pipe"
    if link.startswith("anon_inode:"):
        return "anon-inode"  # epoll, eventfd, timerfd: the event loop's and the kernel libraries' own
    if link.startswith("/dev/"):
        return "dev"
    return "file" if link.startswith("/") else "other"


_TCP_OPEN = {"ESTABLISHED", "SYN_RECV", "SYN_SENT"}


def fd_census() -> Optional[dict]:
    """Open file descriptors by kind: ``tcp-listen``, ``tcp-open`` (connected), ``tcp-closing`` (the peer or we
    closed; a socket the server forgets to close stays here), ``unix`` (the event loop's socket pairs), ``pipe``,
    ``anon-inode``, ``dev``, ``file``, ``other``. None off Linux."""
    import psutil

    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        return None
    sock: dict = {}
    try:
        proc = psutil.Process()
        conns = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6 names it connections
        for c in conns(kind="all"):
            if c.fd < 0:
                continue
            if c.family == getattr(socket, "AF_UNIX", None):
                sock[c.fd] = "unix"
            elif c.status == "LISTEN":
                sock[c.fd] = "tcp-listen"
            elif c.type != socket.SOCK_STREAM:
                sock[c.fd] = "socket-other"
            else:
                sock[c.fd] = "tcp-open" if c.status in _TCP_OPEN else "tcp-closing"
    except (psutil.Error, OSError):
        pass
    out: dict = {}
    for name in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:  # closed between the listing and the read
            continue
        kind = _fd_kind(link, sock.get(int(name)), int(name))
        out[kind] = out.get(kind, 0) + 1
    return out



def memory_census() -> dict:
    """What holds the heap, read directly rather than inferred from a trend: the bytes of every live tensor storage
    (each counted once), grouped by the dtype and the shape it was made for; the bytes Python's own allocator traced
    (``tracemalloc``, when the process started with ``D3D_TRACEMALLOC=1``) with the ten sites that hold most; the
    sizes of the app's own caches. Costs a full walk of the garbage collector's objects (0.1-0.5 s), so ``/health``
    reports it only when ``D3D_MEMORY_CENSUS=1`` (the soak's ``--memory-census``)."""
    import gc
    import sys
    import tracemalloc

    torch = sys.modules.get("torch")
    seen: set = set()
    total = 0
    by_kind: dict = {}
    if torch is not None:
        for o in gc.get_objects():
            if not isinstance(o, torch.Tensor) or o.device.type != "cpu":
                continue
            try:
                st = o.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
            except (RuntimeError, NotImplementedError):  # a meta or packed tensor without a plain storage
                continue
            if ptr in seen or nbytes == 0:
                continue
            seen.add(ptr)
            total += nbytes
            key = f"{str(o.dtype).replace('torch.', '')}{list(o.shape)}"
            by_kind[key] = by_kind.get(key, 0) + nbytes
    top = sorted(by_kind.items(), key=lambda kv: -kv[1])[:8]
    out = {"tensor_mib": round(total / 2**20, 2), "tensors": len(seen), "tensor_top_mib": {k: round(v / 2**20, 2) for k, v in top}}
    if tracemalloc.is_tracing():
        out["py_traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
        stats = tracemalloc.take_snapshot().statistics("lineno")[:10]
        out["py_top_kib"] = {f"{st.traceback[0].filename.split('site-packages/')[-1]}:{st.traceback[0].lineno}": round(st.size / 1024, 1) for st in stats}
    caches = {}
    for mod, name in (("d3d_core.service", "_WARM"), ("d3d_core.service", "_FULL_TAU"), ("d3d_core.training.offline_tau", "_CALIB"),
                      ("d3d_core.models.target", "_ROW_PLANS"), ("d3d_core.models.bundles", "_LOADED")):
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, name):
            caches[f"{mod.rsplit('.', 1)[-1]}.{name}"] = len(getattr(m, name))
    out["cache_entries"] = caches
    out["gc_objects"] = len(gc.get_objects())
    return out


_CENSUS = {"t": 0.0, "value": None}
MEMORY_CENSUS_EVERY_S = 10.0  # a census walks every object: at most one per this many seconds, however often /health is polled


def _memory_census_cached() -> dict:
    now = time.time()
    if _CENSUS["value"] is None or now - _CENSUS["t"] >= MEMORY_CENSUS_EVERY_S:
        _CENSUS["value"], _CENSUS["t"] = memory_census(), now
    return _CENSUS["value"]


def trim() -> None:
    """Return free heap pages to the OS (after a race, an upload): a few ms, glibc only."""
    lib = _libc()
    if lib:
        lib.malloc_trim(0)
