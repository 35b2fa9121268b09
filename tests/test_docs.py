"""Docs that cannot drift: every `python train.py …` command in README.md and docs/ composes (each group option,
key and sweep value it names exists), every relative link resolves, and CI runs the README's test command."""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob
from omegaconf import DictConfig, OmegaConf

from tests.conftest import CONF, REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\$")  # `<teacher run>`, `...`, `$ROOT`: a command to fill in, not to run
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}
SHELL_ENDS = {"&&", "||", ";", "|", ">", ">>", "2>&1"}


@dataclass(frozen=True)
class DocCommand:
    """One `python train.py` command of a docs page: where it is and its Hydra overrides."""

    where: str  # `README.md:123`
    text: str
    overrides: tuple[str, ...]


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every command-like line: fenced code with its `\\` continuations joined, and inline
    code spans."""
    out, fenced, pending, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            start = start or number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line))
            pending, start = "", 0
        else:
            out += [(number, span) for span in re.findall(r"`([^`]*train\.py[^`]*)`", line)]
    return out


def _overrides(command: str) -> tuple[str, ...] | None:
    """The Hydra overrides of `… train.py ARGS`, its flags left out; None for a command that is not one to run."""
    try:
        tokens = shlex.split(command.split("train.py", 1)[1].replace("\\|", "|"), comments=True)
    except ValueError:
        return None
    overrides, skip = [], False
    for token in tokens:
        if token in SHELL_ENDS:
            break
        if skip:
            skip = False
        elif token in FLAGS_WITH_VALUE:
            skip = True
        elif not token.startswith("-") and "=" in token:
            overrides.append(token)
    return tuple(overrides)


def doc_commands(path: Path, text: str | None = None) -> list[DocCommand]:
    """The `python train.py` commands of a docs page (those with placeholders left out)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    found = []
    for number, line in _code_lines(text):
        if not re.search(r"\bpython3? (\S*/)?train\.py\b", line) or PLACEHOLDER.search(line.split("#")[0]):
            continue
        overrides = _overrides(line)
        if overrides is not None:
            found.append(DocCommand(f"{path.name}:{number}", line.strip(), overrides))
    return found


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _runs(overrides: tuple[str, ...]) -> tuple[list[list[str]], list[str]]:
    """The override lists to compose for a command (its sweeps at their first value, each key sweep's other values
    one at a time) and the problems found without composing (a swept group option that does not exist)."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    first, others, problems = [], [], []
    for override in parsed:
        element = override.get_key_element()
        if not override.is_sweep_override():
            first.append(override.input_line)
            continue
        group = override.key_or_group
        is_group = (CONF / group).is_dir()
        value = override.value()
        values = value.filter(_options(group)) if isinstance(value, Glob) else list(override.sweep_string_iterator())
        if not values:
            problems.append(f"{override.input_line} sweeps no value")
            continue
        if is_group:
            problems += [f"{group}={v} is not an option of conf/{group}/ ({', '.join(_options(group))})"
                         for v in values if v not in _options(group)]
        first.append(f"{element}={values[0]}")
        if not is_group and not all(re.fullmatch(r"-?[\d.e+-]+", v) for v in values):  # numbers: the first's type
            others += [(len(first) - 1, f"{element}={v}") for v in values[1:]]
    runs = [first] + [first[:i] + [line] + first[i + 1:] for i, line in others]
    return runs, problems


def _apply(cfg: DictConfig, overrides: list[str]) -> str:
    """Apply key overrides to a composed config as Hydra would (unknown key, wrong type: an error); '' or the
    first error line."""
    for override in OverridesParser.create().parse_overrides(overrides):
        element = override.get_key_element()
        try:
            if element.startswith("~"):
                continue
            value = override.value()
            OmegaConf.update(cfg, override.key_or_group, value, merge=True, force_add=element.startswith("+"))
        except Exception as exc:  # any error is the docs' problem to report
            return f"{override.input_line}: {str(exc).splitlines()[0]}"
    return ""


def check_commands(commands: list[DocCommand]) -> list[str]:
    """Every problem of the commands: `where: command: what is wrong` (an empty list when all compose). Each set of
    group choices is composed once; a command's key overrides are then applied to a copy, as Hydra applies them."""
    problems, composed = [], {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for command in commands:
            runs, found = _runs(command.overrides)
            for run in runs:
                groups = tuple(o for o in run if _is_group(o))
                hydra_keys = any(o.startswith("hydra.") for o in run)  # hydra.launcher.nodes=2 needs Hydra's node
                if (groups, hydra_keys) not in composed:
                    try:
                        cfg = compose("config", overrides=list(groups), return_hydra_config=hydra_keys)
                    except Exception as exc:  # any composition error is the docs' problem to report
                        cfg = str(exc).splitlines()[0]
                    composed[groups, hydra_keys] = cfg
                cfg = composed[groups, hydra_keys]
                if isinstance(cfg, str):
                    found.append(cfg)
                    continue
                error = _apply(copy.deepcopy(cfg), [o for o in run if not _is_group(o)])
                found += [error] if error else []
            problems += [f"{command.where}: {command.text}: {what}" for what in dict.fromkeys(found)]
    return problems


def _is_group(override: str) -> bool:
    """Whether an override line chooses a config group's option (`stage=finetune`, `hydra/launcher=…`)."""
    key = override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]
    return (CONF / key).is_dir() or key.startswith("hydra/")


def test_every_train_command_in_the_docs_composes():
    commands = [c for path in DOCS for c in doc_commands(path)]
    assert len(commands) > 80  # the extraction finds the docs' commands (101 today)
    assert check_commands(commands) == []


def test_a_command_naming_an_option_or_key_that_does_not_exist_is_reported():
    text = "\n".join([
        "Run `python train.py ablation=no_mixup` first.",
        "```bash",
        "python train.py -m 'cait=glob(depth*)' mix=none,no_such_mix \\",
        "    seed=0,1   # a comment",
        ".venv/bin/python train.py train.epoch=3 && echo done",
        "python train.py train.global_batch=lots",
        "python train.py distill.teacher.checkpoint=<teacher run>   # a placeholder: not checked",
        "```",
        "| `python train.py -m ablation=baseline,no_such_row` | a table cell |",
    ])
    commands = doc_commands(Path("PAGE.md"), text)
    assert [c.where for c in commands] == ["PAGE.md:1", "PAGE.md:3", "PAGE.md:5", "PAGE.md:6", "PAGE.md:9"]
    assert commands[1].overrides == ("cait=glob(depth*)", "mix=none,no_such_mix", "seed=0,1")
    problems = check_commands(commands)
    assert len(problems) == 4, problems
    assert problems[0].startswith("PAGE.md:3: ") and "mix=no_such_mix is not an option of conf/mix/" in problems[0]
    assert problems[1].startswith("PAGE.md:5: ") and "train.epoch" in problems[1]
    assert problems[2].startswith("PAGE.md:6: ") and "train.global_batch=lots" in problems[2]
    assert problems[3].startswith("PAGE.md:9: ") and "ablation=no_such_row is not an option" in problems[3]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown page whose file or heading does not exist."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{path.name}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{path.name}: {target}: no heading #{anchor} in {linked.name}")
    return broken


def test_every_path_of_the_package_the_docs_name_exists():
    named = {m for path in DOCS for m in re.findall(r"deit_ablate/[\w/]+(?:\.py|/)", path.read_text(encoding="utf-8"))}
    assert len(named) > 20 and sorted(p for p in named if not (REPO / p).exists()) == []


def test_every_relative_link_in_the_docs_resolves(tmp_path: Path):
    assert [b for path in DOCS for b in broken_links(path)] == []
    page = tmp_path / "PAGE.md"
    (tmp_path / "other.md").write_text("# Other page\n## A section, too\n")
    page.write_text("# Top\n[a](other.md#a-section-too) [b](other.md#nope) [c](missing.md) [d](#top) "
                    "[e](https://example.org/x)\n")
    assert broken_links(page) == ["PAGE.md: other.md#nope: no heading #nope in other.md",
                                  "PAGE.md: missing.md: no such file"]


@pytest.mark.parametrize("marker", ["<!-- test-command -->"])
def test_ci_runs_the_readme_test_command(marker: str):
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    extract = re.search(r"test_command=\$\((.+)\)\n", ci)
    assert extract, ".ci/run no longer reads the README's test command between its markers"
    command = subprocess.run(["bash", "-c", extract.group(1)], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
    assert command == ".venv/bin/python -m pytest"
    assert ci.index("bash scripts/install.sh") < ci.index('bash -c "$test_command"')  # installed before it runs
    assert (REPO / "README.md").read_text(encoding="utf-8").count(marker) == 1
    assert 'bash -c "$test_command"' in ci
