#!/usr/bin/env bash
# Run the whole test suite: fast toy-model tests, real-bundle tests (slow), app and browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh --dev
export GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
echo "[test] ruff check" >&2
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -ra tests "$@"
