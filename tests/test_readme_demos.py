"""The README's study demos say what a reader can judge (issue 39 point 11): each study's demo command with its
seeds, its measured time on a loaded 2-core machine (with the thread setting that keeps that time true in the
command) and the smallest Δ its seeds can tell from seed noise, computed from the measured seed spread."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

import pytest
from conftest import REPO
from hydra.core.override_parser.overrides_parser import OverridesParser

from deit_ablate.analysis.aggregate.stats import LEVEL, t_quantile
from deit_ablate.config.studies import study_names

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # the study-demo table is in docs/studies.md
BEGIN, END = "<!-- study-demos -->", "<!-- /study-demos -->"
THREADS = "runtime.cpu_threads=1"
# Times the README stated without a measurement; on a loaded 2-core machine they were 2-5x short.
VAGUE = ("a few minutes", "minutes on a CPU", "trains in minutes", "Every row is minutes")
COLUMNS = ("study", "demo command", "seeds", "runs", "per run (measured)", "in all", "σ", "resolves")
TIME = re.compile(r"\d+(\.\d+)?\s*(s|min|h)\b")


@dataclass(frozen=True)
class Demo:
    """One row of the README's study-demo table."""

    study: str
    commands: tuple[str, ...]
    seeds: int
    per_run: str
    in_all: str
    sigma: float | None  # the seed spread of top-1 its thresholds use; None where it states no Δ
    resolves: str


def resolvable(sigma: float, seeds: int) -> float:
    """The smallest |Δ| between two rows of `seeds` seeds each that is outside seed noise at the aggregator's level:
    one seed, 2·√2·σ with σ known (the aggregator gives no interval); more, the half-width of its Welch interval
    when both rows spread by σ."""
    z = t_quantile(0.5 + LEVEL / 2.0, 2 * (seeds - 1)) if seeds > 1 else 2.0
    return z * sigma * math.sqrt(2.0 / seeds)


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(text: str) -> list[Demo]:
    """The rows between the study-demo markers; an empty list when the README has no such table."""
    if BEGIN not in text:
        return []
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [h.lower() for h in cells(lines[0])]
    assert header[:8] == list(COLUMNS), header
    demos = []
    for line in lines[2:]:
        c = cells(line.replace("\\|", "¦"))
        commands = tuple(re.findall(r"`([^`]*)`", c[1]))
        demos.append(Demo(c[0].split("`")[1], commands, int(c[2]), c[4], c[5], sigma(c[6]), c[7]))
    return demos


def sigma(cell: str) -> float | None:
    """The σ a row states, or None for `—`."""
    return None if cell.startswith("—") else float(cell.split()[0])


def seeds_of(command: str) -> int:
    found = re.search(r"\bseed=([\d,]+)", command)
    return len(found.group(1).split(",")) if found else 1


def bash_blocks(text: str) -> str:
    return "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S)).replace("\\\n", " ")


@pytest.fixture(scope="module")
def readme() -> str:
    """The README and the docs pages it links, as one text."""
    return "\n".join(page.read_text(encoding="utf-8") for page in PAGES)


def test_every_study_has_a_demo_with_seeds_time_and_what_it_resolves(readme):
    demos = {d.study: d for d in parse(readme)}
    missing = [s for s in study_names() if s not in demos]
    assert not missing, f"studies without a row in the README's study-demo table: {missing}"
    for d in demos.values():
        assert d.commands, d
        for command in d.commands:
            assert command.startswith("python "), (d.study, command)
            if "train.py" in command:
                # the measured time holds on a loaded machine only with one torch thread
                assert THREADS in command, (d.study, command)
                # a teacher trained once for every seed of its students is the one single-seed command allowed
                assert seeds_of(command) in (1, d.seeds), (d.study, command, d.seeds)
        assert max(seeds_of(c) for c in d.commands) == d.seeds, (d.study, d.commands, d.seeds)
        assert TIME.search(d.per_run) and TIME.search(d.in_all), (d.study, d.per_run, d.in_all)
        if d.study in study_names():
            assert d.sigma is not None, d
            stated = re.search(r"\|Δ\| > (\d+(\.\d+)?)", d.resolves.replace("¦", "|"))
            assert stated, (d.study, d.resolves)
            assert float(stated.group(1)) == pytest.approx(resolvable(d.sigma, d.seeds), abs=0.051), (d.study, d)


def test_the_demo_commands_are_the_chapters_commands_and_parse(readme):
    demos = parse(readme)
    assert demos, "the README has no study-demo table"
    blocks = bash_blocks(readme)
    parser = OverridesParser.create()
    for d in demos:
        for command in d.commands:
            assert re.sub(r"\s+", " ", command) in re.sub(r"\s+", " ", blocks), f"not in a bash block: {command}"
            args = shlex.split(command)
            if "train.py" in command:
                parser.parse_overrides([a for a in args[2:] if a != "-m"])


def test_no_unmeasured_times(readme):
    found = [p for p in VAGUE if p in readme]
    assert not found, f"the README states times nobody measured: {found}"


def test_the_threshold_rule():
    # one seed: 2·√2·σ; three: t(0.975, 4) · σ · √(2/3) = 2.27 σ, the aggregator's interval clearing zero
    assert resolvable(1.0, 1) == pytest.approx(2 * math.sqrt(2))
    assert resolvable(1.0, 3) == pytest.approx(2.7764451 * math.sqrt(2 / 3), rel=1e-6)
