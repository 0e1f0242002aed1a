"""The guides, notes and READMEs point at files that exist, and name runs by what and when."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "NOTES.md",
                ROOT / "benchmarks" / "README.md", ROOT / "tools" / "README.md",
                *ROOT.glob("benchmarks/results/*.md")])
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SCRIPT_PATH = re.compile(r"`((?:benchmarks|tools)/[A-Za-z0-9_./-]+)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_script_paths_resolve(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        assert (page.parent / target).exists(), (
            f"{page.relative_to(ROOT)} links to {target}, which does not exist: fix the link")
    for path in SCRIPT_PATH.findall(text):
        assert (ROOT / path).exists(), (
            f"{page.relative_to(ROOT)} names {path}, which does not exist (moved to tools/ "
            "or renamed?): fix the reference")


def test_workshop_folders_name_runs_by_what_and_when():
    """Results are named by what they measure, the machine and the month; text says when a
    figure was measured, not which numbered sitting it came from."""
    folders = [ROOT / "docs", ROOT / "benchmarks", ROOT / "tools"]
    files = [ROOT / "NOTES.md", *(p for f in folders for p in f.rglob("*") if p.is_file())]
    for path in files:
        rel = path.relative_to(ROOT)
        assert "session" not in str(rel).lower(), f"{rel}: name it by what it measures and when"
        if path.suffix in (".md", ".py", ".sh", ".txt", ".json"):
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                assert "session" not in line.lower(), (
                    f"{rel}:{n} says 'session': say what was measured and when (a date, "
                    f"a result file) instead: {line.strip()[:80]}")
