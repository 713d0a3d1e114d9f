"""The README is a short product page, every relative link in it and in docs/ resolves, and no file a reader
sees names an internal work session ("stop 27") instead of something they can look up (a date, a commit)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_BYTES = 10_240
SERVE, TEST = "scripts/serve.sh", "scripts/test.sh"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# "stop 27", "Stop 19", "stop-20", "stop26", "stops 18-20": a work-session number; "stops 15 s before" is a time, not one
SESSION = re.compile(r"\bstops?[- ]?\d+(?:\s*[–-]\s*\d+)?\b(?!\s*(?:s|ms|min|seconds?)\b)", re.I)
SCANNED = ["README.md", "docs", "app", "d3d_core", "scripts"]
TEXT_SUFFIXES = {".md", ".py", ".json", ".sh", ".diff", ".txt", ".toml", ".yaml", ".yml", ".c", ".html"}


def body(text: str) -> str:
    """The README without its Spaces front matter (the YAML between the first two '---' lines)."""
    if text.startswith("---\n"):
        return text.split("\n---\n", 1)[1]
    return text


def relative_links(md: Path):
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL, or an anchor in the same file
        yield target


def test_the_readme_is_a_short_page_that_starts_with_the_two_commands():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move the long parts into docs/"
    text = body(README.read_text(encoding="utf-8"))
    first_block = re.search(r"```[a-z]*\n(.*?)```", text, re.S)
    assert first_block, "README.md has no code block"
    cmds = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert cmds == [SERVE, TEST], cmds
    assert text.index("```") < 1500, "the two commands come right after the 2-3 sentences that say what this is"
    for script in (SERVE, TEST):
        assert (ROOT / script).is_file()


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1
    broken = []
    for md in pages:
        for target in relative_links(md):
            path = (md.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_links_and_skips_urls(tmp_path):
    md = tmp_path / "x.md"
    md.write_text('[a](docs/A.md#x) ![img](img/b.png "t") [u](https://example.org) [s](#here) `[c](not/a/link)`')
    assert list(relative_links(md)) == ["docs/A.md#x", "img/b.png", "not/a/link"]


def test_no_internal_session_numbers():
    found = []
    for top in SCANNED:
        p = ROOT / top
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES]
        for f in files:
            if "__pycache__" in f.parts:
                continue
            for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for m in SESSION.finditer(line):
                    found.append(f"{f.relative_to(ROOT)}:{i}: {m.group(0)!r} in {line.strip()[:120]}")
        if p.is_dir():
            found += [f"{f.relative_to(ROOT)}: file name" for f in p.rglob("*") if SESSION.search(f.name)]
    assert not found, "name a date (and CPU and commit) instead of a work session:\n" + "\n".join(found)


def test_the_session_pattern():
    for hit in ("stop 27's run", "(Stop 19)", "the stop-20 machine", "costs-stop26.json", "stops 18–20"):
        assert SESSION.search(hit), hit
    for miss in ("stops 15 s before its reservation", "Stop sets the race's flag", "a stop ends every one", "stop_race", "nonstop 3"):
        assert not SESSION.search(miss), miss
