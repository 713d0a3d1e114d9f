"""D3D Studio: `python app.py` serves the app (honours GRADIO_SERVER_NAME / GRADIO_SERVER_PORT).

`demo` is the Gradio Blocks app; Hugging Face Spaces imports this file. A deployment recipe made by
``scripts/make_space.py`` may ship ``space-defaults.env`` next to it (KEY=VALUE lines, e.g. the GPU Space's
``D3D_BUNDLE=qwen3-8b``): each is a default that the Space's own variables override. With ``D3D_PRELOAD=1``
the opening bundle is loaded at start-up, in the main process (ZeroGPU's rule: models load outside the GPU window).
On ZeroGPU (``SPACES_ZERO_GPU``) that preload is mandatory whatever ``D3D_PRELOAD`` says: a failed one stops the
Space with its reason, and no request loads a bundle afterwards.
"""

import os
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
_DEFAULTS = Path(__file__).with_name("space-defaults.env")
if _DEFAULTS.is_file():
    for _line in _DEFAULTS.read_text(encoding="utf-8").splitlines():
        _key, _eq, _value = _line.strip().partition("=")
        if _eq and _key and not _key.startswith("#"):
            os.environ.setdefault(_key.strip(), _value.strip())

if os.environ.get("D3D_TRACEMALLOC") == "1":  # the soak's --memory-census: Python's allocations by site, in /health
    import tracemalloc

    tracemalloc.start(1)

from d3d_core.limits import APP_KERNEL_CACHE  # noqa: E402  (no torch inside: the caps below must precede torch)

for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):  # bounded kernel caches: a flat RSS for weeks
    os.environ.setdefault(var, str(APP_KERNEL_CACHE))

from app.spaces_gpu import on_zerogpu  # noqa: E402
from app.ui import build_demo  # noqa: E402  (the app/ package, not this file; imports `spaces` where installed)

if on_zerogpu() or os.environ.get("D3D_PRELOAD") == "1":
    from d3d_core import service  # noqa: E402

    _name = os.environ.get("D3D_BUNDLE") or service.app_bundle()  # the bundle asked for, never a stand-in
    _why = service.preload(_name)
    if _why and on_zerogpu():
        # ZeroGPU: a bundle loads at start-up or not at all (a request thread may not move weights to the GPU), so a
        # Space that cannot load it stops here with the reason in its log, instead of serving races that cannot run
        raise SystemExit(f"[d3d] ZeroGPU: bundle {_name!r} must load at start-up and could not: {_why}")
    if _why:
        print(f"[d3d] the opening bundle was not loaded at start-up: {_why}", flush=True)
    if on_zerogpu():
        service.load_at_startup_only()  # every other bundle is refused with a sentence, never loaded from a request

demo = build_demo()

if __name__ == "__main__":
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        show_error=False,
    )
