"""Server health for whoever hosts the app: uptime, races served, queue length, memory, threads,
open files and the app's temporary files. ``snapshot()`` is what the ``/health`` API endpoint returns
and what the page footer shows; the soak command (``python -m app.soak``) polls it.

Temporary files the app writes for visitors (trace downloads, race exports) live in one directory
per process, ``temp_path()``; files older than ``limits.APP_TEMP_MAX_AGE_S`` are removed whenever a
new one is written, so their number stays bounded however long the server runs."""

from __future__ import annotations

import ctypes
import os
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


def sweep() -> int:
    """Remove temp files past ``APP_TEMP_MAX_AGE_S``: the app's downloads and exports, and the stray
    ``tmp*`` files an upload leaves at the top of Gradio's temp directory (one per upload, beside the
    hashed copy that Gradio's own ``delete_cache`` removes). Returns how many went."""
    now, gone, g = time.time(), 0, gradio_temp_dir()
    stray = [f for f in g.glob("tmp*") if f.is_file()] if g.is_dir() else []
    for f in list(temp_dir().iterdir()) + stray:
        try:
            if now - f.stat().st_mtime > APP_TEMP_MAX_AGE_S:
                f.unlink()
                gone += 1
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
        "py_threads": py_threads(),
    }


def _dur(s: float) -> str:
    s = int(s)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return f"{d} d {h} h" if d else (f"{h} h {m} min" if h else f"{m} min {s % 60} s")


def line(snap: dict) -> str:
    """The footer's one line."""
    q = snap.get("queue_length")
    queue = f"{q} waiting (max {snap.get('queue_max')})" if q is not None else "not started"
    return (f"Server health · up {_dur(snap['uptime_s'])} · {snap['races_served']} races served "
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


def trim() -> None:
    """Return free heap pages to the OS (after a race, an upload): a few ms, glibc only."""
    lib = _libc()
    if lib:
        lib.malloc_trim(0)
