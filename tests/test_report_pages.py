"""A report and a status a newcomer can trust (issue 47, points 1-3): a study's table shows only its own runs and names
the others in one line, Table 7 compares each transfer with the same network trained from scratch, and the HTML page
reads at a glance at common widths (measured in a real browser, headless chromium).

One module fixture writes an output root that holds several studies, as a newcomer's does after the README and a
study page: two Table 8 rows, two DeiT III rows, a transfer and two from-scratch runs on the transfer's data (one
trained as long as the transfer, one longer), as wandb offline logs written with the real wandb library.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deit_ablate.analysis.aggregate import cli
from deit_ablate.config.studies import paper_tables
from tests.conftest import TINY, run_train, write_offline_runs

SHAPES, SHAPES_B = "4a7852e162e65685", "d99b4b509ef1ac62"  # the built-in data's digests: shapes, shapes_b
DEMO_VIT = {"name": "deit_tiny_patch16_224", "kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 1}}
DEIT3_VIT = {"name": "vit_base_patch16_224", "kwargs": {"patch_size": 8, "embed_dim": 32, "depth": 1,
                                                        "init_values": 0.0001}}
CHROMIUM = Path("/usr/bin/chromium")
WIDTHS = (1000, 1400, 2200)
ONE_SEED = "one seed per row: no spread, so no ± and no interval"  # said once, in the caption


def _run(rid: str, top1: float, stage: str = "pretrain", digest: str = SHAPES, epochs: int = 5,
         network: dict | None = None, **choices: str) -> dict:
    """One finished demo run as train.py logs it: its recorded choices, data fingerprint, model and epochs."""
    every = {"ablation": "baseline", "recipe": "deit", "preset": "demo", "stage": stage, "model": "vit_demo",
             "data": "builtin", "resolution": f"demo_{stage}", **choices}
    config = {"ablation": every["ablation"], "stage": stage, "seed": 0, "preset": "demo", "choices": every,
              "model": network or DEMO_VIT, "data": {"name": "builtin", "num_classes": 10},
              "data_fingerprint": {"digest": digest}, "train": {"epochs": epochs}, "transfer": {"epochs": 5},
              "resolution": {"train_size": 48 if stage == "transfer" else 32}}
    if "deit3" in choices:
        config["augment"] = {"three_augment": choices["deit3"] == "baseline"}
    return {"id": rid, "root": "outputs", "group": "", "tags": [], "config": config,
            "summary": {"status": "finished", "top1": top1}}


MIXED = [
    _run("t8-base", 60.0), _run("t8-sgd", 50.0, ablation="sgd"),
    _run("d3-base", 55.0, network=DEIT3_VIT, deit3="baseline", recipe="deit3", model="vit_base"),
    _run("d3-ra", 57.0, network=DEIT3_VIT, deit3="randaugment", recipe="deit3", model="vit_base"),
    _run("tr", 58.0, stage="transfer", digest=SHAPES_B, transfer="builtin_b"),
    _run("scratch", 59.0, digest=SHAPES_B),  # `data.builtin.classes=shapes_b train.epochs=5`, as long as the transfer
    _run("scratch10", 64.0, digest=SHAPES_B, epochs=10),  # trained longer: not the transfer's comparison
]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wandb folder of an output root that holds Table 8, DeiT III and transfer runs."""
    tmp = tmp_path_factory.mktemp("mixed")
    write_offline_runs(MIXED, tmp)
    return tmp / "outputs" / "wandb"


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert cli.main([*argv, "--format", "json", "-q"]) == 0
    return json.loads(capsys.readouterr().out)


def _markdown(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main([*argv, "-q"]) == 0
    return capsys.readouterr().out


def test_table8_shows_only_its_study_and_names_the_others_in_one_line(mixed, capsys):
    table = _json([str(mixed)], capsys)
    assert table["paper"]["table"] == "table8" and table["stages"] == ["pretrain", "finetune"]  # no transfer column
    present = [r["key"] for r in table["rows"] if r["cells"]["pretrain"]["n"]]
    assert present == ["baseline", "sgd"], present  # no `baseline · recipe=deit3, ...` sub-rows
    also = f"Also in {mixed}: 3 runs of transfer, 2 of deit3 (see --paper table7 / --paper deit3)."
    assert table["meta"]["also"] == also
    lines = _markdown([str(mixed)], capsys).splitlines()
    last_row = max(i for i, line in enumerate(lines) if line.startswith("| "))
    assert lines[last_row + 2] == also  # the first line under the table


def test_transfer_is_compared_with_the_same_network_trained_from_scratch(mixed, capsys, tmp_path):
    page = tmp_path / "t7.html"
    argv = [str(mixed), "--paper", "table7"]
    assert cli.main([*argv, "--format", "html", "--plot", str(tmp_path / "t7.png"), "--out", str(page), "-q"]) == 0
    html = re.sub(r'src="data:image/png;base64,[^"]*"', 'src=""', page.read_text())
    sections = re.findall(r"<h2>(.*?)</h2>", html)
    assert sections[0] == "Δ to the same network trained from scratch", sections  # was "Δ to None"
    assert "None" not in html
    text = _markdown(argv, capsys)
    assert "| transfer | ours transfer @48 | ours from scratch | Δ | paper transfer top-1 |" in text
    assert "| builtin_b | 58.00 | 59.00 | -1.00 | not in the text |" in text
    assert "- from scratch: pre-train, 5 epochs at 32 px" in text  # what was run names it
    table = _json(argv, capsys)
    row = next(r for r in table["rows"] if r["key"] == "builtin_b")
    assert table["reference"] == "from scratch" and row["reference"]["run_ids"] == ["scratch"]  # not the longer one
    assert row["cells"]["transfer"]["delta"] == pytest.approx(58.0 - 59.0)
    assert table["meta"]["also"] == f"Also in {mixed}: 2 runs of ablation, 2 of deit3 (see --paper table8 / --paper " \
                                    "deit3)."


def test_one_seed_is_said_once_and_missing_rows_point_to_only_present(mixed, capsys, tmp_path):
    page = tmp_path / "deit3.html"
    assert cli.main([str(mixed), "--paper", "deit3", "--format", "html", "--out", str(page), "-q"]) == 0
    html = page.read_text()
    cells = re.findall(r"<td>(.*?)</td>", html)
    assert not [c for c in cells if "n=1" in c], "every cell said n=1"
    assert html.count(ONE_SEED) == 1 and "Δ 95% CI" not in html  # said in the caption; no column of empty intervals
    rows = len(paper_tables()["deit3"]["rows"])  # two of them with runs
    assert f"{rows - 2} of {rows} rows have no runs (missing): --only-present hides them" in html
    assert cli.main([str(mixed), "--paper", "deit3", "--only-present", "--format", "html", "--out", str(page),
                     "-q"]) == 0
    assert "rows have no runs" not in page.read_text()


# --- the page in a real browser --------------------------------------------------------------------------------------

MEASURE = """<script>
(() => {
  const width = document.documentElement.clientWidth, out = [];
  for (const table of document.querySelectorAll("table")) {
    for (let box = table.parentElement; box; box = box.parentElement) {
      if (box.scrollWidth > box.clientWidth + 1) out.push(`${box.tagName} around a table scrolls: ` +
                                                           `${box.scrollWidth} > ${box.clientWidth} px`);
    }
  }
  for (const el of document.querySelectorAll("th, td, img, h1, h2, p")) {
    const r = el.getBoundingClientRect(), style = getComputedStyle(el);
    if (r.right > width + 1 || r.left < -1) out.push(`${el.tagName} "${el.textContent.slice(0, 40)}" spans ` +
                                                     `${Math.round(r.left)}..${Math.round(r.right)} of ${width} px`);
    if (style.transform !== "none" || style.writingMode !== "horizontal-tb") out.push(`${el.tagName} is rotated`);
  }
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify({width: window.innerWidth, page: document.documentElement.scrollWidth,
                                    problems: out});
  document.body.appendChild(pre);
})();
</script></body>"""


def _chromium(args: list[str], profile: Path) -> str:
    """Headless chromium with a fresh profile and no background traffic; its stdout."""
    shutil.rmtree(profile, ignore_errors=True)
    profile.mkdir(parents=True)
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--hide-scrollbars", f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def measure(page: Path, width: int, work: Path) -> dict:
    """The page at `width` px as the browser lays it out: the viewport, the page's width and what sticks out."""
    probe = work / f"probe-{width}-{page.name}"
    probe.write_text(page.read_text().replace("</body>", MEASURE))
    dom = _chromium([f"--window-size={width},1200", "--virtual-time-budget=3000", "--dump-dom", probe.as_uri()],
                    work / "profile")
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert found, f"the browser wrote no measurement for {page.name} at {width} px"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&gt;", ">")
                      .replace("&lt;", "<"))


def screenshot(page: Path, width: int, png: Path, work: Path) -> Path:
    """A PNG of the page's first 2,000 px at `width`."""
    _chromium([f"--window-size={width},2000", f"--screenshot={png}", page.as_uri()], work / "profile")
    return png


@pytest.fixture(scope="module")
def browser() -> Path:
    """/usr/bin/chromium; skipped where it is missing outside CI, a failure under CI (.ci/run installs it)."""
    if not CHROMIUM.exists():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("/usr/bin/chromium is missing under CI: .ci/run installs Debian's chromium")
        pytest.skip("no /usr/bin/chromium (apt-get install -y --no-install-recommends chromium)")
    return CHROMIUM


@pytest.mark.slow
@pytest.mark.parametrize("paper", ["deit3", "table7", "table8"])
def test_the_html_page_reads_at_1000_1400_and_2200_px(browser, mixed, paper, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"browser-{paper}")
    page = work / f"{paper}.html"
    assert cli.main([str(mixed), "--paper", paper, "--format", "html", "--out", str(page), "-q"]) == 0
    for width in WIDTHS:
        seen = measure(page, width, work)
        assert seen["width"] == width and seen["page"] <= width, seen
        assert seen["problems"] == [], (paper, width, seen["problems"][:10])
        png = screenshot(page, width, work / f"{paper}-{width}.png", work)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- a newcomer's output root, trained by train.py ------------------------------------------------------------------

SHORT = ["finetune.epochs=1", "transfer.epochs=1", "transfer.global_batch=32"]


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    """README's plain run, then docs/transfer.md's demo (fine-tune, transfer, the from-scratch run on the second
    built-in set) and a DeiT III row in the same output root, at the tiny test scale; its wandb folder."""
    cwd = tmp_path_factory.mktemp("newcomer")
    steps = ([], ["stage=finetune"], ["transfer=builtin_b"], ["data.builtin.classes=shapes_b"], ["deit3=baseline"])
    for extra in steps:
        run_train([*extra, *TINY, *SHORT], cwd, data_cache)
    return cwd / "outputs" / "wandb"


def _sections(html: str) -> dict[str, str]:
    """Each <h2> section's title and what follows it up to the next section."""
    parts = re.split(r"<h2>(.*?)</h2>", html.split("</table>")[-1])
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.slow  # five train.py runs, about a minute on two cores
def test_a_newcomers_reports_have_content_in_every_section(newcomer: Path, tmp_path: Path, capsys) -> None:
    text = _markdown([str(newcomer), "--plot", str(tmp_path / "table8.png")], capsys)  # README's command
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| ablation | ours pre-train @32 |") and "transfer" not in rows[0], rows[0]
    assert rows[1].startswith("| baseline | ") and "missing" not in rows[1], rows[1]  # both stages have a number
    assert not [row for row in rows if " · " in row], "another study's runs became sub-rows"
    assert f"Also in {newcomer}: 2 runs of transfer, 1 of deit3 (see --paper table7 / --paper deit3)." in text
    for paper in ("table8", "table7", "deit3"):
        page = tmp_path / f"{paper}.html"
        assert cli.main([str(newcomer), "--paper", paper, "--format", "html", "--out", str(page), "-q"]) == 0
        html = page.read_text()
        sections = _sections(html)
        assert list(sections) == [next(iter(sections)), "Validation top-1 by epoch"] and \
            next(iter(sections)).startswith("Δ to "), (paper, list(sections))
        for title, body in sections.items():
            image = re.search(r'src="data:image/png;base64,([^"]*)"', body)
            assert image and len(image.group(1)) > 10_000, (paper, title)
        assert "None" not in re.sub(r'src="data:image/png;base64,[^"]*"', "", html), paper
    transfer = _json([str(newcomer), "--paper", "table7"], capsys)
    (row,) = [r for r in transfer["rows"] if r["cells"]["transfer"]["n"]]
    assert row["key"] == "builtin_b" and row["reference"]["n"] == 1 and row["cells"]["transfer"]["delta"] is not None

