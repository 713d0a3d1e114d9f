"""Regenerate tests/fixtures/toy_traces.json: one race of all four modes on the toy bundle.

    .venv/bin/python scripts/make_trace_fixture.py [--out tests/fixtures/toy_traces.json]

The figure tests read this file instead of decoding, so they run without a model. Tokens, rounds
and hypotheses are deterministic (toy bundle, seed 0); span times are whatever this machine took.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from d3d_core.decoding.config import DecodeConfig  # noqa: E402
from d3d_core.decoding.engine import decode  # noqa: E402
from d3d_core.decoding.trace import MODES, traces_to_json  # noqa: E402
from d3d_core.models.bundles import get_bundle  # noqa: E402

PROMPT = "what is two plus two?"
SETTINGS = dict(block_size=4, max_new_tokens=40, hypotheses=8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "toy_traces.json"))
    args = ap.parse_args(argv)
    toy = get_bundle("toy")
    traces = [decode(toy, PROMPT, DecodeConfig(mode=m, **SETTINGS)) for m in MODES]
    Path(args.out).write_text(traces_to_json(traces, indent=1))
    print(f"wrote {args.out}: {', '.join(f'{t.mode} ({len(t.rounds)} rounds)' for t in traces)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
