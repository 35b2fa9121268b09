"""The numbers the docs present as measured are scripts/docs_numbers.py's: each page's generated sections are what the
script renders from docs/measured.json (the transfer page's recipe table from the resolved config), each names a
commit of this repository's history, and no covered page states a demo accuracy outside them. The aggregator's page
lists every paper table and says what a report shows of a run's commit."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deit_ablate.analysis.aggregate.about import facts
from deit_ablate.analysis.aggregate.paper import table_names
from deit_ablate.run.commands import prepare_configs

REPO = Path(__file__).resolve().parents[1]


def docs_numbers():
    """scripts/docs_numbers.py as a module (it is a script, not part of the package)."""
    if "docs_numbers_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("docs_numbers_script", REPO / "scripts" / "docs_numbers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["docs_numbers_script"] = module
        spec.loader.exec_module(module)
    return sys.modules["docs_numbers_script"]


def measured() -> dict:
    return json.loads((REPO / "docs" / "measured.json").read_text())


def test_every_page_the_script_covers_has_its_figures():
    assert sorted(measured()) == sorted(docs_numbers().PAGES)


@pytest.mark.parametrize("page", sorted(docs_numbers().PAGES))
def test_a_pages_generated_sections_are_what_the_script_renders(page):
    """A hand edit inside a section, or a figure changed in measured.json without the page, fails here."""
    prepare_configs()
    script = docs_numbers()
    text = (REPO / script.PAGES[page].file).read_text()
    assert text == script.render_page(page, measured()), (
        f"{script.PAGES[page].file} differs from what `python scripts/docs_numbers.py --pages {page} --render-only` "
        "writes")


@pytest.mark.parametrize("page", sorted(docs_numbers().PAGES))
def test_a_pages_figures_name_commits_of_this_history(page):
    figures = measured()[page]
    assert figures["commits"], page
    for commit in figures["commits"]:
        assert re.fullmatch(r"[0-9a-f]{40}", commit), f"{page}: {commit!r} is not a clean commit (dirty, or none)"
        found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], check=False)
        assert found.returncode == 0, f"{page}: commit {commit} is not in this repository's history"
        assert commit[:10] in (REPO / docs_numbers().PAGES[page].file).read_text()


# A top-1 as the aggregator prints ours (two decimals) or in per cent, in a sentence about our runs.
MEASURED_FIGURE = re.compile(r"\b[1-9]\d\.\d{2}\b|\b[1-9]\d\.\d ?%")
OURS = re.compile(r"\b(demo|ours|our runs|reaches|reached|gave|seed 0|trained in|measured)\b")


def stated_outside_sections(text: str) -> list[str]:
    """The sentences outside generated sections that state a figure of our runs."""
    script = docs_numbers()
    outside = script.RESOLVED.sub("", script.SECTION.sub("", text))
    sentences = re.split(r"(?<=[.:;])\s+|\n\n", outside)
    return [s.strip() for s in sentences if MEASURED_FIGURE.search(s) and OURS.search(s)]


@pytest.mark.parametrize("page", sorted(docs_numbers().PAGES))
def test_no_demo_accuracy_is_stated_outside_the_generated_sections(page):
    stated = stated_outside_sections((REPO / docs_numbers().PAGES[page].file).read_text())
    assert not stated, f"{docs_numbers().PAGES[page].file} states measured figures by hand: {stated}"


def test_the_rule_finds_a_hand_typed_demo_figure():
    assert stated_outside_sections("The pre-training reaches 62.1 % on `shapes` and the fine-tune 60.9 %.")
    assert stated_outside_sections("| layer_decay_075 | baseline | | | | | 33.80 |\nour demo table")
    assert not stated_outside_sections("DeiT III found 3-Augment better (83.1 % against 82.7 %).")


def test_the_aggregation_page_lists_every_paper_table():
    text = (REPO / "docs" / "aggregation.md").read_text()
    listed = re.search(r"`--paper auto\\\|none((?:\\\|\w+)*)`", text)
    assert listed, "docs/aggregation.md has no `--paper auto|none|...` option line"
    assert sorted(listed[1].split("\\|")[1:]) == table_names()


def test_the_aggregation_page_says_a_report_names_our_runs_commit():
    """train.py writes git_commit into a run's config, and the report's 'What was run' names it."""
    from deit_ablate.analysis.aggregate import RunInfo, build_table

    commit = "31e1abe11ce5e5d9e3aa509e974e2096f9b4f907"
    run = RunInfo(run_id="a", config={"git_commit": commit, "seed": 0, "stage": "pretrain"},
                  summary={"status": "finished", "top1": 60.0})
    shown = dict(facts(build_table([run], rows="seed", paper="none")))
    assert shown["commit"] == commit[:12]
    text = " ".join((REPO / "docs" / "aggregation.md").read_text().split())
    assert "our runs show `commit: not recorded`" not in text
    assert f"(`commit: {commit[:12]}`)" in text


def test_the_seed_spread_the_pages_reason_with_is_the_measured_one():
    """Every page's thresholds use σ = 0.7 (the plain demo) or 1.4 (`sam=baseline`): the spread measured's, rounded."""
    spread = measured()["spread"]
    sigmas = {f"{spread[name]['sigma']:.1f}" for name in ("demo", "sam_baseline")}
    script = docs_numbers()
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = script.SECTION.sub("", path.read_text())
        stated = set(re.findall(r"σ = (\d+\.\d)\b(?! would)", text))
        assert stated <= sigmas, f"{path.name} reasons with σ = {stated - sigmas}; the measured spread is {sigmas}"
    studies = (REPO / "docs" / "studies.md").read_text()
    assert f"| {spread['demo']['sigma']:.1f} (the plain demo, 5 seeds) |" in studies
    assert f"| {spread['sam_baseline']['sigma']:.1f} (`sam=baseline`, 2 seeds) |" in studies
