"""A real headless browser (Debian chromium via playwright) loads the page, runs a short race
on the real bundle, opens every tab (and each section of a tab split into sections) and checks that the plots
rendered and that none is taller than 2,000 px at 1500 x 1000. Screenshots go to
$D3D_SCREENSHOTS (default: tests/screenshots, git-ignored)."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PAGE_MAX_PX = 2000  # at 1500 x 1000, after a short race, no tab (and no section of one) is taller than this
# the tabs split into short sections, one shown at a time: (the sections' container, their names, the first to show a plot)
SECTIONS = {
    "Timeline": ("#timeline-sections", ["Both lanes, in ms", "Economics of this run"], "Both lanes, in ms"),
    "Benchmarks": ("#bench-sections", ["Measured bench", "Acceptance and block size", "Where the time goes", "Engines",
                                       "int4 step costs", "Model check", "Projections"], "Acceptance and block size"),
    "How it works": ("#explain-sections", ["Start here", "1 · Draft, then verify", "2 · Verify plan, draft gate", "3 · DFlash",
                                           "4 · D3D during verify", "5 · A deeper drafter", "6 · Skipping drafter layers",
                                           "Which τ is which", "Glossary", "Words"], "1 · Draft, then verify"),
}


@pytest.fixture(scope="module")
def server(app_server):
    return app_server[1]


@pytest.fixture(scope="module")
def page():
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium is not installed (scripts/setup_venv.sh --dev installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        pg = browser.new_page(viewport={"width": 1500, "height": 1000})
        yield pg
        browser.close()


def _shot(page, name):
    d = Path(os.environ.get("D3D_SCREENSHOTS", ROOT / "tests" / "screenshots"))
    d.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(d / f"{name}.png"), full_page=True)


def _page_height(page) -> int:
    return page.evaluate("() => Math.max(document.documentElement.scrollHeight, document.body.scrollHeight)")


def _set_slider(page, label, value):
    box = page.get_by_label(f"number input for {label}")
    box.fill(str(value))
    box.press("Enter")


def test_race_and_every_tab(server, page):
    page.goto(server, wait_until="domcontentloaded")
    page.get_by_text("D3D Studio", exact=False).first.wait_for()
    _set_slider(page, "Max new tokens", 24)  # the default prompt, shortened
    page.locator("#run").click()
    page.locator("#status").get_by_text("Done", exact=False).wait_for(timeout=240_000)
    counts = set()
    for m in ("ar", "dflash", "d3d-seq", "d3d-async"):
        text = page.locator(f"#col-{m}").inner_text()
        found = re.search(r"done: (\d+) tokens", text)
        assert found, text
        counts.add(found.group(1))
    assert len(counts) == 1  # lossless: every mode printed the same number of tokens
    assert page.locator(".tok.bonus").count() > 0
    # the economics of each run sit under its counters, and the status says why each mode was as fast as it was
    col = page.locator("#col-d3d-seq").inner_text()
    assert "break-even τ = round" in col or "implausible reading" in col, col  # a flagged reading gets no break-even τ
    assert re.search(r"\d\.\d\d× \(\d\.\d\d–\d\.\d\d\) the speed of ar|too short to time", page.locator("#status").inner_text())
    _shot(page, "1-race")
    heights = {"Race": _page_height(page)}
    for tab, name in (("Rounds", "2-rounds"), ("Timeline", "3-timeline"), ("Acceptance", "4-acceptance"),
                      ("Pruning", "5-pruning"), ("Benchmarks", "5b-benchmarks"), ("How it works", "6-explain")):
        page.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(1500)
        heights[tab] = _page_height(page)
        _shot(page, name)
        sel, names, plotted = SECTIONS.get(tab, (None, [], None))
        if sel:  # the first section is the one shown; each section in turn, none taller than a page
            shown = [t.inner_text().strip() for t in page.locator(f"{sel} [role=tab]").all() if t.is_visible()]
            assert shown == names, shown
            for i, sub in enumerate(names):
                page.locator(f"{sel} [role=tab]").filter(has_text=sub).first.click()
                page.wait_for_timeout(800)
                heights[f"{tab} › {sub}"] = _page_height(page)
                if sub == plotted:
                    _plots_rendered(page, tab)
                _shot(page, f"{name}-{i}")
            page.locator(f"{sel} [role=tab]").filter(has_text=names[0]).first.click()
        else:
            _plots_rendered(page, tab)
    tall = {k: v for k, v in heights.items() if v > PAGE_MAX_PX}
    assert not tall, f"taller than {PAGE_MAX_PX} px at 1500 x 1000: {tall} (all: {heights})"
    page.get_by_role("tab", name="Traces").click()
    page.get_by_role("button", name="Prepare download").click()
    # the downloaded file by its name (other texts name .json files too: the Projections hit-rate label names its source)
    page.get_by_text(re.compile(r"d3d-traces-.*\.json")).first.wait_for(timeout=20_000)
    _shot(page, "7-traces")


def _plots_rendered(page, tab):
    n = page.locator(".js-plotly-plot:visible").count()
    assert n >= 1, f"no plot rendered on the {tab} tab"
    if tab == "Timeline":
        assert page.locator(".js-plotly-plot:visible .barlayer .point").count() > 10
    if tab == "Rounds":
        assert page.locator(".js-plotly-plot:visible .heatmaplayer, .js-plotly-plot:visible image").count() >= 1


def test_clock_and_export(server, page, tmp_path):
    """After the race above: re-time the Timeline under a projected GPU profile and back, export the
    race as one HTML file, and open that file in the browser with no server."""
    page.get_by_role("tab", name="Timeline").click()
    page.wait_for_timeout(500)
    title = lambda: page.locator(".js-plotly-plot:visible .gtitle").first.text_content()  # noqa: E731 (SVG text)
    assert "PROJECTED" not in title()
    page.locator("#clock").get_by_text("qwen3-8b on H200 (derived)", exact=True).click()
    page.wait_for_function("() => [...document.querySelectorAll('.gtitle')].some(e => e.textContent.includes('PROJECTED'))", timeout=30_000)
    assert "PROJECTED" in title()
    _shot(page, "3b-timeline-projected")
    page.locator("#clock").get_by_text("as measured (the race's own clock)", exact=True).click()
    page.wait_for_function("() => ![...document.querySelectorAll('.gtitle')].some(e => e.textContent.includes('PROJECTED'))", timeout=30_000)
    page.get_by_role("tab", name="Race", exact=True).click()
    page.locator("#export").click()
    link = page.locator("#export-file a").first
    link.wait_for(timeout=60_000)
    with page.expect_download() as dl:
        link.click()
    out = tmp_path / "race.html"
    dl.value.save_as(str(out))
    page.goto(out.as_uri())
    page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
    assert page.locator(".d3d-col").count() == 4 and page.locator(".tok.bonus").count() > 0
    assert page.locator(".js-plotly-plot .barlayer .point").count() > 10  # the timeline drew offline
    _shot(page, "8-exported-race")


def test_race_with_the_deep_drafter(server, page):
    """The Race tab's D3D-drafter picker: race d3d-seq with d3d-deep; its column names the drafter that ran and
    prints exactly ar's tokens. Last in the file: the tests above read the four-mode race of the first test."""
    page.goto(server, wait_until="domcontentloaded")
    page.get_by_text("D3D Studio", exact=False).first.wait_for()
    _set_slider(page, "Max new tokens", 16)
    for m in ("dflash", "d3d-async"):
        page.get_by_label(m, exact=True).uncheck()
    page.locator("#d3d-drafter label").filter(has_text="d3d-deep: ").click()
    page.locator("#run").click()
    page.locator("#status").get_by_text("Done", exact=False).wait_for(timeout=240_000)
    assert "d3d-deep" in page.locator("#status").inner_text()
    seq = page.locator("#col-d3d-seq").inner_text()
    assert "30 drafter layers" in seq and "adapters" in seq, seq
    done = {m: re.search(r"done: (\d+) tokens", page.locator(f"#col-{m}").inner_text()).group(1) for m in ("ar", "d3d-seq")}
    assert done["ar"] == done["d3d-seq"] == "16", done
    _shot(page, "1b-race-deep")


def test_recorded_race_opens_at_once_and_presenter_view(server, page):
    """📼 pressed right after the page loads: the recorded race fills the Race columns and the Rounds tab (the page-load
    refresh of the Pruning tab must not overwrite it); the presenter view enlarges the type and ?presenter opens in it."""
    page.goto(server, wait_until="domcontentloaded")
    page.get_by_text("D3D Studio", exact=False).first.wait_for()
    page.locator("#preset-recorded").click()  # at once: the Pruning tab's page-load refresh is still running
    page.locator("#status").get_by_text("Recorded race", exact=False).wait_for(timeout=60_000)
    page.wait_for_timeout(6000)
    done = {m: re.search(r"done: (\d+) tokens", page.locator(f"#col-{m}").inner_text()).group(1) for m in ("ar", "d3d-seq", "d3d-async")}
    assert len(set(done.values())) == 1, done
    h = _page_height(page)  # the default race at full length (176 tokens), not a shortened one
    _shot(page, "1c-race-recorded")
    assert h <= PAGE_MAX_PX, f"the Race tab after the recorded default race is {h} px tall at 1500 x 1000"
    # a long answer scrolls inside its box with its end in view (the answer), not its start
    end_in_view = """m => { const box = document.querySelector('#col-' + m + ' .d3d-text'); const toks = box.querySelectorAll('.tok');
        const b = box.getBoundingClientRect(), t = toks[toks.length - 1].getBoundingClientRect(), f = toks[0].getBoundingClientRect();
        return [box.scrollHeight > box.clientHeight, t.bottom <= b.bottom + 1 && t.top >= b.top - 1, f.top < b.top]; }"""
    for m in ("ar", "d3d-seq"):
        overflows, last_seen, first_hidden = page.evaluate(end_in_view, m)
        assert overflows and last_seen and first_hidden, (m, overflows, last_seen, first_hidden)
    page.get_by_role("tab", name="Rounds").click()
    page.get_by_text("Round 0", exact=False).first.wait_for(timeout=20_000)
    assert page.get_by_text("Run a race first", exact=False).count() == 0
    page.get_by_role("tab", name="Race", exact=True).click()
    size = "() => parseFloat(getComputedStyle(document.querySelector('#col-ar .d3d-col')).fontSize)"
    small = page.evaluate(size)
    page.locator("#presenter input").check()
    page.wait_for_timeout(500)
    assert page.evaluate("() => document.body.classList.contains('d3d-presenter')")
    assert page.evaluate(size) >= 1.4 * small
    _shot(page, "1c-recorded-presenter")
    page.locator("#presenter input").uncheck()
    page.wait_for_timeout(300)
    assert page.evaluate(size) == small
    page.goto(server + "?presenter", wait_until="domcontentloaded")
    page.get_by_text("D3D Studio", exact=False).first.wait_for()
    page.wait_for_function("() => document.body.classList.contains('d3d-presenter')", timeout=20_000)
