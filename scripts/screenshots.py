"""Screenshots of every tab for a fresh reader's review (docs/review/): the first visit, then, after the 📼 recorded
race (or a live race with --live), every tab and every section; with --open-panels each tab again with its folded
panels (accordions and "details") opened, so a reader sees what the text points to.

    .venv/bin/python scripts/screenshots.py OUT_DIR [--live] [--presenter] [--open-panels]

Runs the app in-process on a free port and drives Debian's chromium through playwright (never `playwright install`).
"""

from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.chdir(ROOT)

from conftest import free_port  # noqa: E402
from test_browser import CHROMIUM, FLAGS, SECTIONS  # noqa: E402

TABS = ("Rounds", "Timeline", "Acceptance", "Pruning", "Benchmarks", "How it works", "Traces")


def _open_panels(page, everywhere: bool = False) -> list:
    """Open every visible folded panel of the open tab (Gradio accordions and HTML <details>; with ``everywhere``
    also those above the tabs); returns the accordion buttons opened, for ``_close_panels``."""
    page.evaluate("""all => { for (const d of document.querySelectorAll('details:not([open])')) {
        if (d.offsetParent && (all || d.closest('[role=tabpanel]'))) { d.open = true; d.dataset.shotOpened = '1'; } } }""",
                  everywhere)
    # element handles, not locators: a locator matching ":not(.open)" would match other buttons once these are open
    opened = [b for b in page.query_selector_all("button.label-wrap:not(.open)")
              if b.is_visible() and (everywhere or b.evaluate("b => !!b.closest('[role=tabpanel]')"))]
    for btn in opened:
        btn.click()
    page.wait_for_timeout(1200)
    return opened + (["details"] if page.locator("details[data-shot-opened]").count() else [])


def _close_panels(page, opened: list) -> None:
    """Fold again what ``_open_panels`` opened, so the next screenshot shows the page as a visitor finds it."""
    page.evaluate("""() => { for (const d of document.querySelectorAll('details[data-shot-opened]')) {
        d.open = false; delete d.dataset.shotOpened; } }""")
    for btn in opened:
        if btn != "details":
            btn.click()
    page.wait_for_timeout(800)


def main(argv: list[str]) -> None:
    args = [a for a in argv if not a.startswith("--")]
    out = args[0] if args else "/tmp/d3d-shots"
    live, presenter, panels = "--live" in argv, "--presenter" in argv, "--open-panels" in argv
    os.makedirs(out, exist_ok=True)
    demo = runpy.run_path("app.py", run_name="d3d_app")["demo"]
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, show_error=False)
    from playwright.sync_api import sync_playwright

    n = [0]

    def shot(page, name: str) -> None:
        n[0] += 1
        page.screenshot(path=f"{out}/{n[0]:02d}-{name}.png", full_page=True)

    def shot_open(page, name: str, everywhere: bool = False) -> None:
        if panels and (opened := _open_panels(page, everywhere)):
            shot(page, name + "-panels-open")
            _close_panels(page, opened)

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = b.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/" + ("?presenter" if presenter else ""), wait_until="domcontentloaded")
        page.get_by_text("D3D Studio", exact=False).first.wait_for()
        page.wait_for_timeout(3000)
        shot(page, "first-visit")
        if live:
            page.locator("#run").click()
            page.locator("#status").get_by_text("Done", exact=False).wait_for(timeout=600_000)
        else:
            page.locator("#preset-recorded").click()
            page.locator("#status").get_by_text("Recorded race", exact=False).wait_for(timeout=60_000)
        page.wait_for_timeout(3000)
        shot(page, "race")
        for tab in TABS:
            page.get_by_role("tab", name=tab, exact=True).click()
            page.wait_for_timeout(2500)
            slug = tab.lower().replace(" ", "-")
            sel, names, _ = SECTIONS.get(tab, (None, [], None))
            if tab == "Rounds":
                shot(page, "rounds-r0")
                for r in (1, 2, 3):
                    page.get_by_role("button", name="next round ▶").click()
                    page.wait_for_timeout(1500)
                    shot(page, f"rounds-r{r}")
                shot_open(page, "rounds-r3")
                continue
            if not sel:
                shot(page, slug)
                shot_open(page, slug)
                continue
            for i, sub in enumerate(names):
                page.locator(f"{sel} [role=tab]").filter(has_text=sub).first.click()
                page.wait_for_timeout(1500)
                shot(page, f"{slug}-{i}")
                shot_open(page, f"{slug}-{i}")
        if panels:  # the Race tab last: its panels open below the columns
            page.get_by_role("tab", name="Race", exact=True).click()
            page.wait_for_timeout(1500)
            shot_open(page, "race", everywhere=True)
        b.close()
    demo.close()
    print("screenshots in", out, n[0])


if __name__ == "__main__":
    main(sys.argv[1:])
