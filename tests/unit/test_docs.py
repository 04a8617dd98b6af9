"""The README and docs/: the figures tables (and docs/performance.md's serving table) equal what
benchmarks/figures.py builds from the results files, every Markdown link resolves (files and heading anchors), and the README stays a front page
that starts with the two commands."""

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import figures  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (outside code fences)."""
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", figures.PAGES, ids=lambda p: p.name)
def test_the_checked_in_figures_table_is_what_the_results_files_say(page):
    text = page.read_text()
    assert figures.rendered(page, text) == text, "stale figures table: run python benchmarks/figures.py"


def test_a_figure_that_disagrees_with_its_file_is_caught(tmp_path):
    page = REPO / "README.md"
    table = figures.table()
    first = table.splitlines()[2]
    cells = first.split(" | ")
    tampered = page.read_text().replace(first, " | ".join([cells[0], "700,000 layer-tokens/s", *cells[2:]]))
    assert tampered != page.read_text() and figures.rendered(page, tampered) != tampered


def test_a_serving_table_that_disagrees_with_its_file_is_caught():
    page = REPO / "docs" / "performance.md"
    text = page.read_text()
    block = figures.SERVING.search(text)
    assert block is not None, "docs/performance.md has no serving table"
    row = next(line for line in block.group(3).splitlines() if line.startswith("| tier |"))
    tampered = text.replace(row, row.replace("| tier |", "| tier-pd |"))
    assert tampered != text and figures.rendered(page, tampered) == text


def test_the_tail_table_sets_the_clients_shares_without_each_first_interval_beside_the_engines_where_a_point_has_them():
    shares = {"10": 0.005, "25": 0.001, "50": 0.0, "100": 0.0}
    engine = {"intervals": 100, "over_ms": {"10": 0.001, "25": 0.0, "50": 0.0, "100": 0.0}}
    new = {"rate": 1.0, "itl_over_ms": shares, "itl_over_ms_later": {"10": 0.001, "25": 0.0, "50": 0.0, "100": 0.0},
           "first_itl": {"p50": 14.2, "p99": 30.0}, "engine_itl": engine}  # fmt: skip
    old = {"rate": 2.0, "itl_over_ms": shares, "engine_itl": engine}  # a point of a sweep from before they were kept
    rows = figures._tail_table({"results": {"tier-pd": {"17408": [old, new]}}})
    assert "| client without each request's first interval, % | first interval p50 / p99 (ms) |" in rows[-4]
    assert rows[-2:] == ["| tier-pd | 17408 | 1 | 0.50 / 0.10 / 0.00 | 0.10 / 0.00 / 0.00 | 14.2 / 30.0 | 0.10 / 0.00 / 0.00 |",
                         "| tier-pd | 17408 | 2 | 0.50 / 0.10 / 0.00 | - | - | 0.10 / 0.00 / 0.00 |"]  # fmt: skip
    # no point with them: the table as before, without those two columns
    assert "first interval" not in "\n".join(figures._tail_table({"results": {"tier-pd": {"17408": [old]}}}))


def test_the_ttft_table_sets_the_tiers_and_the_pools_records_beside_the_clients_ttft_where_a_point_has_them():
    pool = {"ttft": {"count": 40, "mean_ms": 700.0, "over_s": {"1.0": 0.1}}, "queue": {"count": 40, "mean_ms": 420.5, "over_s": {"1.0": 0.125}},
            "kv_wait": {"count": 0}, "batch": {"count": 31, "mean_ms": 250.0, "over_s": {"1.0": 0.0}}}  # fmt: skip
    steps = {"requests": 40, "pool_ttft": {"p50": 300.0, "p99": 3800.0}, "received_to_prefilled": {"p50": 310.0, "p99": 3850.0},
             "prefilled_to_first_token_sent": {"p50": 1.2, "p99": 4.0}}  # fmt: skip
    new = {"rate": 2.0, "ttft": {"p50": 448.4, "p99": 3911.8}, "pool": pool, "tier_steps": steps}
    old = {"rate": 1.0, "ttft": {"p50": 300.0, "p99": 1200.0}}  # a point of a sweep from before they were kept
    rows = figures._ttft_table({"results": {"tier-pd": {"17408": [old, new]}}})
    assert rows[-1] == "| tier-pd | 17408 | 2 | 448.4 / 3,911.8 | 310.0 / 3,850.0 | 300.0 / 3,800.0 | 1.2 / 4.0 | 40, 420.5 ms, 12% | 0 | 31, 250.0 ms, 0% |"
    assert len([row for row in rows if row.startswith("| tier-pd")]) == 1  # the older point has no row
    assert figures._ttft_table({"results": {"tier-pd": {"17408": [old]}}}) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_markdown_link_resolves(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to missing {target}"
        if anchor:
            assert anchor in _anchors(resolved), f"{page.name}: no heading #{anchor} in {resolved.name}"


def test_the_readme_is_a_front_page_that_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert lines[2] == "```bash" and "mlapool prefill" in lines[3] and "python -m pytest -q" in lines[4]
    test_command = lines[4].split("#")[0].strip()
    assert test_command.replace("pip install", "python -m pip install -q") in (REPO / ".ci" / "run").read_text()
