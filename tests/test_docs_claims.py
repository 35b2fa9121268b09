"""What the pages say a command does is what it does, in the terms a user types: `--cfg job` prints a stage as it
will run only with `--resolve`; `deit3=baseline` and `recipe=deit3 model=vit_base` are one recipe under two run
folders; the transfer page says what is, not how it came to be."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import compose_config, identity_of

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "PERFORMANCE.md")]


def flat(path: Path) -> str:
    return " ".join(path.read_text().split())


def as_it_will_run() -> list[tuple[str, str]]:
    """(page, command) of each `--cfg job` command a page says prints a run as it will run."""
    found = []
    for path in PAGES:
        for command in re.findall(r"`(python train\.py [^`]*--cfg job[^`]*)` prints [^.]*as it will run", flat(path)):
            found.append((path.name, command))
    return found


def test_a_cfg_job_said_to_print_a_run_as_it_will_run_resolves_it():
    claims = as_it_will_run()
    assert claims, "no page says what `--cfg job` prints as it will run"
    for page, command in claims:
        assert "--resolve" in command.split(), f"{page}: `{command}` prints ${{at_scale:...}} unresolved"


def test_the_readmes_cfg_job_command_prints_values_not_interpolations():
    (_, command), = [claim for claim in as_it_will_run() if claim[0] == "README.md"]
    proc = subprocess.run([sys.executable, "train.py", *command.split()[2:]], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)
    assert "${" not in proc.stdout and "lr: 1.0e-05" in proc.stdout, proc.stdout[-2000:]


def test_deit3_baseline_and_the_recipe_option_are_one_recipe_in_two_folders():
    """One digest and wandb id, two folder names: launching both trains it twice, as docs/deit3.md says."""
    study, option = (identity_of(overrides) for overrides in (["deit3=baseline"], ["recipe=deit3", "model=vit_base"]))
    assert study.digest == option.digest and study.run_id == option.run_id
    assert study.name != option.name
    text = flat(REPO / "docs" / "deit3.md")
    assert "`deit3=baseline` is this option" not in text
    assert "two run folders" in text and "launching both trains the same network twice" in text
    assert compose_config(["deit3=baseline"]).model.name == compose_config(["model=vit_base"]).model.name


def test_the_transfer_page_tells_no_development_history():
    text = flat(REPO / "docs" / "transfer.md")
    history = [phrase for phrase in ("session", "earlier digest", "from before the key", "measured again at commit",
                                     "with this fix", "predates") if phrase in text]
    assert not history, f"docs/transfer.md tells its history: {history}"


HISTORY_NAME = re.compile(r"session|round|issue[-_ ]?\d+", re.IGNORECASE)


def test_measurement_files_are_named_by_what_they_measure_not_by_the_work_that_made_them():
    names = [p.name for p in (REPO / "docs").iterdir()]
    assert not [n for n in names if HISTORY_NAME.search(n)], names
    for path in (REPO / "docs").glob("bench-*.json"):  # what, the device, the commit: bench-<what>-<device>-<commit>
        assert re.fullmatch(r"bench-[a-z0-9-]+-(cpu|gpu)-[0-9a-f]{7,40}\.json", path.name), path.name


def test_the_performance_page_is_a_reference_with_no_dated_sections():
    text = (REPO / "docs" / "PERFORMANCE.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    dated = [h for h in headings if re.search(r"session|issue|\bround\b|\(change \d|\d{4}-\d{2}-\d{2}|before|now",
                                              h, re.IGNORECASE)]
    assert not dated, dated
    assert "## The GPU node: the host's share of a step and the loader" in headings
    assert len(text.splitlines()) < 200, "a reference read in five minutes"
    assert not re.search(r"\bsession \d+|\bissue \d+\b", text, re.IGNORECASE)


def test_no_page_or_code_comment_dates_itself_by_a_round_of_work():
    files = [*PAGES, REPO / "docs" / "PERFORMANCE.md", *(REPO / "deit_ablate").rglob("*.py")]
    found = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in files
             for m in re.finditer(r"\b(?:before|after|since|in) session \d+", p.read_text())]
    assert not found, found
