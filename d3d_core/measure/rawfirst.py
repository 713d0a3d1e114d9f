"""Raw results first: no measuring command loses its run to a summary step.

Every measuring command (bench, costs, latency, distill, train, prune, shortlist, levers,
offline_tau) follows one rule:

1. what it measured (rows, cost tables, checkpoints, samples) reaches the disk **before** any
   summary, table, model fit or validation runs — for a JSON command as ``<out stem>.raw.json``,
   written atomically (temp file + ``os.replace``), so a kill leaves the old file or the new one;
2. every summary / post-processing step runs through :class:`Steps`: a step that raises prints one
   line to stderr naming the step and the error (``error: summary step 'latency_model' failed:
   TypeError: ... (at latency.py:108); raw results kept in results/bench.raw.json``), is recorded
   in the output JSON under ``failed_steps`` (``[{"step", "error", "at"}]``), the other steps still
   run and write what they can, and the command exits 1.

    steps = Steps(raw=raw_path(out))
    steps.save_raw({"config": ..., "rows": rows})          # before any summary
    summary = steps.run("summary", summarize, rows, default=[])
    with steps.step("print"):
        print(table_text(summary))
    return steps.finish(out, result)                        # writes out (+ failed_steps); 0, or 1 if a step failed

The raw file is removed once the full result is on disk and no step failed (the result holds
everything the raw file did); otherwise it stays beside the result.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Optional


def _jsonable(x):
    """JSON fallback for what a measurement may hold besides plain Python values (numpy / torch scalars,
    paths, sets): never lose a raw file to its encoder."""
    if hasattr(x, "item") and callable(x.item):
        try:
            return x.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if hasattr(x, "tolist") and callable(x.tolist):
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x, key=str)
    return str(x)


def write_json_atomic(path, data, indent: Optional[int] = 1) -> Path:
    """Write ``data`` as JSON to ``path`` through a temp file in the same directory and ``os.replace``:
    readers (and a kill mid-write) see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=indent, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def raw_path(out) -> Path:
    """``results/bench.json`` -> ``results/bench.raw.json``."""
    out = Path(out)
    return out.with_name(out.with_suffix("").name + ".raw.json")


def _where(e: BaseException) -> str:
    """file:line of the innermost frame of the exception's traceback ('' without one)."""
    tb = traceback.extract_tb(e.__traceback__)
    return f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""


class Steps:
    """Runs a command's named summary steps; a failing step is reported and recorded, the rest go on.

    ``raw``: where the raw results are (or will be) kept, named in the error line. ``failed``: the
    records ``{"step", "error", "at"}`` of the steps that raised, in order."""

    def __init__(self, raw=None, stream=None):
        self.raw = Path(raw) if raw is not None else None
        self.stream = stream
        self.failed: list = []

    @property
    def ok(self) -> bool:
        return not self.failed

    def fail(self, name: str, e: BaseException) -> None:
        err = f"{type(e).__name__}: {e}".strip()
        at = _where(e)
        self.failed.append({"step": name, "error": err, "at": at})
        kept = f"; raw results kept in {self.raw}" if self.raw is not None and self.raw.exists() else ""
        print(f"error: summary step {name!r} failed: {err}" + (f" (at {at})" if at else "") + kept,
              file=self.stream or sys.stderr)

    @contextmanager
    def step(self, name: str):
        """``with steps.step("print"): ...`` — an exception inside is recorded, not raised."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 — the point: any failure of a summary step is reported, not fatal
            self.fail(name, e)

    def run(self, name: str, fn, *args, default=None, **kwargs):
        """``fn(*args, **kwargs)``, or ``default`` when it raises (the failure recorded)."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self.fail(name, e)
            return default

    def save_raw(self, data, path=None) -> Optional[Path]:
        """Write the raw results atomically to ``path`` (default ``self.raw``). A failure to write them
        is recorded like a failed step (the command goes on, and still writes its result)."""
        target = Path(path) if path is not None else self.raw
        if target is None:
            raise ValueError("Steps.save_raw needs a path")
        return self.run("save_raw", write_json_atomic, target, data)

    def record(self, doc: dict) -> dict:
        """``doc`` with ``failed_steps`` set when a step failed (left out otherwise); returns doc."""
        if self.failed:
            doc["failed_steps"] = [dict(f) for f in self.failed]
        else:
            doc.pop("failed_steps", None)
        return doc

    def exit_code(self, rc: int = 0) -> int:
        """``rc``, or 1 when a step failed (and rc was 0)."""
        return 1 if (self.failed and rc == 0) else rc

    def finish(self, out, doc: dict, write=None) -> int:
        """Record failures in ``doc``, write it to ``out`` (``write(out, doc)``, default an atomic JSON
        write), drop the raw file when everything succeeded, and return the exit code."""
        self.record(doc)
        before = len(self.failed)
        self.run("write", write or write_json_atomic, out, doc)
        if len(self.failed) > before and self.raw is not None:  # the result did not reach ``out``: keep all of it as raw
            self.save_raw(self.record(doc))
        if self.ok and self.raw is not None and self.raw.exists() and Path(out).resolve() != self.raw.resolve():
            self.raw.unlink()
        return self.exit_code()
