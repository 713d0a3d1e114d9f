"""D3D Studio: `python app.py` serves the app (honours GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).

`demo` is the Gradio Blocks app; Hugging Face Spaces imports this file.
"""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
from d3d_core.limits import APP_KERNEL_CACHE  # noqa: E402  (no torch inside: the caps below must precede torch)

for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):  # bounded kernel caches: a flat RSS for weeks
    os.environ.setdefault(var, str(APP_KERNEL_CACHE))

from app.ui import build_demo  # noqa: E402  (the app/ package, not this file)

demo = build_demo()

if __name__ == "__main__":
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        show_error=False,
    )
