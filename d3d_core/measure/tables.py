"""Plain-text and Markdown tables of result rows (bench, latency model, costs): no model code."""

from __future__ import annotations

SUMMARY_COLS = ["dataset", "mode", "n", "tau", "tokens_per_s", "speedup", "lossless_rate", "hit_rate", "overlap", "tokens"]


def _fmt(v) -> str:
    """A table cell: floats to 2 decimals, None (not measured / not applicable, e.g. a peer's τ) as "—"."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def table_text(summary: list, cols=SUMMARY_COLS) -> str:
    """A plain-text table of dict rows (the bench summary by default)."""
    cells = [[_fmt(s.get(c)) for c in cols] for s in summary]
    w = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w[i]) for i, c in enumerate(cols))
    body = ["  ".join(r[i].ljust(w[i]) for i in range(len(cols))) for r in cells]
    return "\n".join([line, "  ".join("-" * x for x in w), *body])


def table_markdown(summary: list, cols=SUMMARY_COLS) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "\n".join("| " + " | ".join(_fmt(s.get(c)) for c in cols) + " |" for s in summary) + "\n"
