#!/usr/bin/env bash
# Serve the app on the bundled default (smollm2-135m). Honours GRADIO_SERVER_NAME / GRADIO_SERVER_PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
export GRADIO_ANALYTICS_ENABLED=False
exec .venv/bin/python app.py "$@"
