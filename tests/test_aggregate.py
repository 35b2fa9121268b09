"""The aggregator end to end, on real offline runs written by the real wandb library.

One subprocess writes about two dozen offline runs (two seeds per row, a diverged row, a failed and an
unfinished run, a requeued run id, a preset and a group to filter out, a distillation ladder); the test
then adds a copy of a run cut mid-record and a log cut inside its header, and checks every number of the
tables the command line prints. No W&B server is involved anywhere.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from deit_ablate.analysis.aggregate import cli
from deit_ablate.analysis.aggregate.curves import plot_curves
from deit_ablate.analysis.aggregate.html import to_html
from deit_ablate.analysis.aggregate.plot import draw_deltas
from deit_ablate.analysis.aggregate.reader import RunInfo, read_run_file
from deit_ablate.analysis.aggregate.render import render
from deit_ablate.analysis.aggregate.select import dedup, row_keys
from deit_ablate.analysis.aggregate.table import build_table, row_spec
from deit_ablate.analysis.aggregate.wandb_log import encode_log, read_log
from tests.conftest import write_offline_runs

NAN = float("nan")
SQRT2, SQRT_HALF = math.sqrt(2.0), math.sqrt(0.5)


def _run(rid, ablation, stage, seed, summary, group="table8", preset="demo", distill="none", root="main"):
    size = 32 if stage == "pretrain" else 48
    config = {
        "ablation": ablation,
        "stage": stage,
        "seed": seed,
        "preset": preset,
        "run_id": rid,
        "model": {"name": "vit_demo"},
        "data": {"name": "builtin"},
        "distill": {"type": distill},
        "resolution": {"train_size": size, "eval_size": size},
    }
    return {
        "id": rid,
        "root": root,
        "group": group,
        "tags": [ablation, stage, preset],
        "config": config,
        "summary": summary,
    }


def _done(top1, **extra):
    return {"status": "finished", "top1": top1, "top1_final": top1, "top1_best": top1, **extra}


RUNS = [
    _run("base-p0", "baseline", "pretrain", 0, _done(50.0)),
    _run("base-p1", "baseline", "pretrain", 1, _done(52.0)),
    _run("base-f0", "baseline", "finetune", 0, _done(60.0)),
    _run("base-f1", "baseline", "finetune", 1, _done(61.0)),
    _run("base-paper", "baseline", "pretrain", 7, _done(99.0), preset="paper"),  # filtered by --preset demo
    _run("sgd-p0", "sgd", "pretrain", 0, _done(40.0)),
    _run("sgd-p1", "sgd", "pretrain", 1, _done(44.0)),
    _run("sgd-p2", "sgd", "pretrain", 2, {"status": "diverged", "top1": 3.0}),  # counted apart, not averaged
    _run("sgd-f0", "sgd", "finetune", 0, _done(50.0)),
    _run("aa-p0", "autoaugment", "pretrain", 0, {"status": "failed"}),
    _run("nomix-p0", "no_mixup", "pretrain", 0, {"top1": 10.0}),  # preempted: no status ...
    _run("nomix-p0", "no_mixup", "pretrain", 0, _done(47.0)),  # ... requeued under the same id, finished
    _run("nomix-p1", "no_mixup", "pretrain", 1, _done(49.0)),
    _run("nomix-f0", "no_mixup", "finetune", 0, {"top1": 12.0}),  # still running
    _run("nocut-p0", "no_cutmix", "pretrain", 0, _done(45.5)),
    _run("nocut-p1", "no_cutmix", "pretrain", 1, _done(46.5), root="staging"),  # copied in, cut mid-record
    _run("noerase-p0", "no_erasing", "pretrain", 0, {"status": "diverged", "top1": NAN}),
    _run("noerase-p1", "no_erasing", "pretrain", 1, {"status": "diverged", "top1": NAN}),
    _run("ema-p0", "ema", "pretrain", 0, _done(51.5, top1_ema_final=53.0, top1_ema_best=53.5)),
    _run("ema-p1", "ema", "pretrain", 1, _done(52.5, top1_ema_final=54.0, top1_ema_best=54.5)),
    _run("kd-none0", "baseline", "pretrain", 0, _done(50.0), group="distill"),
    _run("kd-none1", "baseline", "pretrain", 1, _done(51.0), group="distill"),
    _run("kd-hard0", "baseline", "pretrain", 0, _done(52.0), group="distill", distill="hard"),
    _run(
        "kd-token0",
        "baseline",
        "pretrain",
        0,
        group="distill",
        distill="hard_token",
        summary=_done(53.0, top1_cls=51.0, top1_dist=52.5, top1_fused=53.0, top1_fused_alt=52.9),
    ),
]

# Table 8 as it must come out with --group table8 --preset demo:
# row -> stage -> (state, mean, std, n, diverged, failed, unfinished, delta, paper, paper_std, paper_delta)
MISSING = ("missing", None, None, 0, 0, 0, 0, None)
EXPECTED = {
    "baseline": {
        "pretrain": ("ok", 51.0, SQRT2, 2, 0, 0, 0, 0.0, 81.8, 0.2, 0.0),
        "finetune": ("ok", 60.5, SQRT_HALF, 2, 0, 0, 0, 0.0, 83.1, 0.1, 0.0),
    },
    "sgd": {
        "pretrain": ("ok", 42.0, 2 * SQRT2, 2, 1, 0, 0, -9.0, 74.5, None, -7.3),
        "finetune": ("ok", 50.0, None, 1, 0, 0, 0, -10.5, 77.3, None, -5.8),
    },
    "sgd_finetune": {"pretrain": MISSING + (81.8, None, 0.0), "finetune": MISSING + (83.1, None, 0.0)},
    "no_randaugment": {"pretrain": MISSING + (79.6, None, -2.2), "finetune": MISSING + (80.4, None, -2.7)},
    "autoaugment": {
        "pretrain": ("failed", None, None, 0, 0, 1, 0, None, 81.2, None, -0.6),
        "finetune": MISSING + (81.9, None, -1.2),
    },
    "no_mixup": {
        "pretrain": ("ok", 48.0, SQRT2, 2, 0, 0, 0, -3.0, 78.7, None, -3.1),
        "finetune": ("unfinished", None, None, 0, 0, 0, 1, None, 79.8, None, -3.3),
    },
    "no_cutmix": {
        "pretrain": ("ok", 46.0, SQRT_HALF, 2, 0, 0, 0, -5.0, 80.0, None, -1.8),
        "finetune": MISSING + (80.6, None, -2.5),
    },
    "no_mixup_cutmix": {"pretrain": MISSING + (75.8, None, -6.0), "finetune": MISSING + (76.7, None, -6.4)},
    "no_erasing": {
        "pretrain": ("diverged", None, None, 0, 2, 0, 0, None, 4.3, None, -77.5),
        "finetune": MISSING + (0.1, None, -83.0),
    },
    "no_drop_path": {"pretrain": MISSING + (3.4, None, -78.4), "finetune": MISSING + (0.1, None, -83.0)},
    "no_repeated_aug": {"pretrain": MISSING + (76.5, None, -5.3), "finetune": MISSING + (77.4, None, -5.7)},
    "dropout": {"pretrain": MISSING + (81.3, None, -0.5), "finetune": MISSING + (83.1, None, 0.0)},
    "ema": {
        "pretrain": ("ok", 52.0, SQRT_HALF, 2, 0, 0, 0, 1.0, 81.9, None, 0.1),
        "finetune": MISSING + (83.1, None, 0.0),
    },
}
FIELDS = ("state", "mean", "std", "n", "diverged", "failed", "unfinished", "delta", "paper", "paper_std", "paper_delta")
TABLE8 = ["--group", "table8", "--preset", "demo"]


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(b, str):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Write the runs with wandb (offline) in a subprocess, then add a cut copy and a broken log."""
    tmp = tmp_path_factory.mktemp("agg")
    write_offline_runs(RUNS, tmp)
    wandb_dir = tmp / "main" / "wandb"
    source = next((tmp / "staging" / "wandb").glob("offline-run-*-nocut-p1"))
    copy = wandb_dir / source.name
    shutil.copytree(source, copy)
    log = copy / "run-nocut-p1.wandb"
    data = log.read_bytes()
    log.write_bytes(data[:-3])  # inside the last record (the exit record): the summary before it is intact
    broken = wandb_dir / "offline-run-20200101_000000-broken"
    broken.mkdir()
    (broken / "run-broken.wandb").write_bytes(data[:20])  # cut inside the first record
    return tmp


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    assert cli.main([*argv, "--format", "json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_table8_every_number(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, err = _json([str(runs_dir / "main" / "wandb"), *TABLE8], capsys)
    assert [r["key"] for r in data["rows"]] == list(EXPECTED)
    for row in data["rows"]:
        for stage, expected in EXPECTED[row["key"]].items():
            cell = row["cells"][stage]
            for name, want in zip(FIELDS, expected, strict=True):
                assert _close(cell[name], want), (row["key"], stage, name, cell[name], want)
    flagged = {r["key"] for r in data["rows"] if r["note"] == "did not train well"}
    assert flagged == {"no_erasing", "no_drop_path"}
    assert data["stage_sizes"] == {"pretrain": [32], "finetune": [48]}
    assert data["baseline"] == "baseline" and data["paper"]["table"] == "table8"
    meta = data["meta"]
    assert (meta["read"], meta["filtered_out"], meta["duplicates"], meta["counted"]) == (24, 5, 1, 18)
    assert meta["dropped_duplicates"] == [
        {"run_id": "nomix-p0", "status": "unfinished", "source": meta["dropped_duplicates"][0]["source"]}
    ]
    cut = str(runs_dir / "main" / "wandb")
    assert "cut inside a record" in err and "nocut-p1" in err and cut in err
    assert "run-broken.wandb" in err and "no run record" in err


def test_markdown_cells(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(runs_dir / "main"), *TABLE8]) == 0  # the parent of wandb/ works too
    lines = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()}
    assert lines["baseline"].startswith("| baseline | 51.00 ± 1.41 (n=2) | +0.00 | 81.8 ± 0.2 | +0.0 |")
    assert "| 60.50 ± 0.71 (n=2) | +0.00 | 83.1 ± 0.1 | +0.0 |" in lines["baseline"]
    # sgd [40, 44] vs baseline [50, 52]: v = 8/2 + 2/2 = 5, ν = 25 / (16 + 1) = 1.47, t_{0.975, 1.47} = 6.188,
    # Δ -9 ± 6.188 · sqrt(5) = [-22.84, +4.84] (holds 0: ○); pooled s² = (8 + 2) / 2 = 5, paper Δ -7.3:
    # 15.698 · 5 / 53.29 = 1.5 -> 2 seeds per arm
    assert "| 42.00 ± 2.83 (n=2; +1 diverged) | -9.00 ○ | 74.5 | -7.3 | [-22.84, +4.84] | 2 |" in lines["sgd"]
    assert "| 50.00 (n=1) | -10.50 | 77.3 | -5.8 | n=1, no spread | 2 |" in lines["sgd"]
    assert "| diverged (2) |" in lines["no_erasing †"]
    assert "| unfinished (1) |" in lines["no_mixup"] and "| failed (1) |" in lines["autoaugment"]
    assert lines["dropout"].startswith("| dropout | missing |")


def test_csv_round_trip(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = runs_dir / "t8.csv"
    assert cli.main([str(runs_dir / "main" / "wandb"), *TABLE8, "--format", "csv", "--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["row"] for r in rows] == list(EXPECTED)
    for row in rows:
        for stage, expected in EXPECTED[row["row"]].items():
            for name, want in zip(FIELDS, expected, strict=True):
                got = row[f"{stage}_{name}"]
                assert _close(None if got == "" else got, want), (row["row"], stage, name, got, want)


def test_latex_and_plot(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = runs_dir / "plots" / "t8.png"
    assert cli.main([str(runs_dir / "main" / "wandb"), *TABLE8, "--format", "latex", "--plot", str(png)]) == 0
    tex = capsys.readouterr().out
    assert r"\begin{tabular}" in tex and r"no\_erasing $^\dagger$" in tex and r"51.00 $\pm$ 1.41" in tex
    data = png.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[2] in (3, 4)


def test_no_filters_count_every_run(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, err = _json([str(runs_dir / "main" / "wandb")], capsys)
    rows = {r["key"]: r["cells"]["pretrain"] for r in data["rows"]}
    # baseline's pre-training: the table8 seeds 0 and 1 and the distill group's runs of the same experiment and
    # seeds (counted once per seed, the latest); a paper-preset run and the distilled runs are other experiments
    base = rows["baseline"]
    assert base["n"] == 2 and _close(base["mean"], 50.5) and sorted(base["same_seed"]) == ["base-p0", "base-p1"]
    assert "repeat a seed already counted (base-p" in err
    assert list(rows)[:4] == [
        "baseline",
        "baseline · distill.type=hard",
        "baseline · distill.type=hard_token",
        "baseline · preset=paper",
    ]
    assert _close(rows["baseline · preset=paper"]["mean"], 99.0) and rows["baseline · preset=paper"]["paper"] is None
    assert _close(rows["baseline · preset=paper"]["delta"], 99.0 - 50.5)
    assert _close(rows["baseline · distill.type=hard_token"]["mean"], 53.0)
    split = data["splits"][0]
    assert (split["row"], split["stage"], split["varied"]) == ("baseline", "pretrain", ["distill.type", "preset"])
    assert "baseline (pre-train): runs differ in distill.type, preset; split into 'baseline' (4)" in err
    data, _ = _json([str(runs_dir / "main" / "wandb"), "--tag", "no_mixup", "--group", "tab*"], capsys)
    assert [r["key"] for r in data["rows"] if r["cells"]["pretrain"]["state"] != "missing"] == ["no_mixup"]
    assert data["rows"][5]["cells"]["pretrain"]["delta"] is None  # no baseline among these runs
    assert cli.main([str(runs_dir / "main" / "wandb"), *TABLE8, "--until", "2000-01-01"]) == 2  # none left
    assert "error: no run left: --since/--until leave none of the 24 run(s) read" in capsys.readouterr().err
    tomorrow = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
    data, _ = _json([str(runs_dir / "main" / "wandb"), *TABLE8, "--since", "2000-01-01", "--until", tomorrow], capsys)
    assert data["meta"]["counted"] == 18


def test_metric_ema(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = _json([str(runs_dir / "main" / "wandb"), *TABLE8, "--metric", "ema"], capsys)
    rows = {r["key"]: r["cells"]["pretrain"] for r in data["rows"]}
    assert data["metric_key"] == "top1_ema_final"
    assert rows["ema"]["state"] == "ok" and _close(rows["ema"]["mean"], 53.5) and rows["ema"]["n"] == 2
    assert rows["baseline"]["state"] == "n/a" and rows["baseline"]["no_metric"] == 2
    assert rows["ema"]["delta"] is None  # the baseline has no EMA number


def test_rows_distill(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, _ = _json([str(runs_dir / "main"), "--rows", "distill", "--group", "distill"], capsys)
    assert data["rows_key"] == "distill.type" and data["paper"]["table"] == "table3"
    assert data["baseline"] == "none"
    want = {  # key: (state, mean, std, n, delta, paper, paper_delta, paper finetune, its delta)
        "none": ("ok", 50.5, SQRT_HALF, 2, 0.0, 81.8, 0.0, 83.1, 0.0),
        "soft": ("missing", None, None, 0, None, 81.8, 0.0, 83.2, 0.1),
        "hard": ("ok", 52.0, None, 1, 1.5, 83.0, 1.2, 84.0, 0.9),
        "hard_token": ("ok", 53.0, None, 1, 2.5, 83.4, 1.6, 84.5, 1.4),
        "soft_token": ("missing", None, None, 0, None, None, None, None, None),
    }
    assert [r["key"] for r in data["rows"]] == list(want)
    for row in data["rows"]:
        pre, fine = row["cells"]["pretrain"], row["cells"]["finetune"]
        got = (
            pre["state"],
            pre["mean"],
            pre["std"],
            pre["n"],
            pre["delta"],
            pre["paper"],
            pre["paper_delta"],
            fine["paper"],
            fine["paper_delta"],
        )
        assert all(_close(g, w) for g, w in zip(got, want[row["key"]], strict=True)), (row["key"], got)
        assert fine["state"] == "missing"
    data, _ = _json([str(runs_dir / "main"), "--rows", "distill", "--group", "distill", "--metric", "cls"], capsys)
    token = data["rows"][3]["cells"]
    assert _close(token["pretrain"]["mean"], 51.0) and token["pretrain"]["paper"] == 83.0
    assert token["finetune"]["paper"] == 84.2 and data["rows"][0]["cells"]["pretrain"]["state"] == "n/a"


def test_rows_resolution(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, err = _json([str(runs_dir / "main"), "--rows", "resolution", *TABLE8], capsys)
    assert data["paper"] is None  # Table 10's sizes (160..384) are not the demo's sizes
    assert "paper table10 left out: its rows (resolution.train_size: 160, 224, 320, 384) match none" in err
    keys = [r["key"] for r in data["rows"]]
    assert keys[0] == "32" and keys.index("48") == 7  # each size's Table 8 rows are other experiments: sub-rows
    assert "32 · ablation=sgd" in keys and "48 · ablation=no_mixup" in keys and len(keys) == 10
    small, large = data["rows"][0]["cells"], data["rows"][7]["cells"]
    assert small["pretrain"]["n"] == 2 and _close(small["pretrain"]["mean"], 51.0)  # the baseline is the main one
    assert large["finetune"]["n"] == 2 and _close(large["finetune"]["mean"], 60.5)
    data, err = _json([str(runs_dir / "main"), "--rows", "resolution", *TABLE8, "--match-baseline"], capsys)
    assert [r["key"] for r in data["rows"]] == ["32", "48"] and len(data["meta"]["not_matching_baseline"]) == 14
    assert "kept '32' (2 run(s)), left out 12 run(s) of 6 other setting(s) (--match-baseline)" in err
    assert row_keys("mix") == ("mix.mixup_alpha", "mix.cutmix_alpha") and row_keys("a.b,c") == ("a.b", "c")
    old_log = {"mix": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}}  # a run logged before the group choices were
    assert row_spec("mix").label(old_log) == "mixup_alpha=0.8,cutmix_alpha=1"
    assert row_spec("mix").label({**old_log, "choices": {"mix": "mixup_cutmix"}}) == "mixup_cutmix"
    data, _ = _json([str(runs_dir / "main"), "--rows", "distill", *TABLE8], capsys)  # logs without group choices
    assert data["rows_key"] == "distill.type" and [r["key"] for r in data["rows"] if r["cells"]["pretrain"]["n"]]
    assert cli.main([str(runs_dir / "main"), "--rows", "mix"]) == 2  # no mix choice, no mix.* keys in these runs
    assert "no run logged a 'mix' group choice, and none has mix.mixup_alpha" in capsys.readouterr().err


def test_single_run_folder_and_file(runs_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = next((runs_dir / "main" / "wandb").glob("offline-run-*-sgd-f0"))
    data, _ = _json([str(folder)], capsys)
    assert data["meta"]["read"] == 1 and data["rows"][1]["cells"]["finetune"]["mean"] == 50.0
    data, _ = _json([str(folder / "run-sgd-f0.wandb"), str(folder)], capsys)  # two sources, one run id
    assert data["meta"]["read"] == 2 and data["meta"]["duplicates"] == 1


def test_reader_agrees_with_wandb_leet(runs_dir: Path) -> None:
    """Cross-check against wandb's own (Go) reader, `wandb leet inspect`, where it is available."""
    wandb_bin = Path(sys.executable).with_name("wandb")
    log = next((runs_dir / "main" / "wandb").glob("offline-run-*-ema-p1")) / "run-ema-p1.wandb"
    try:
        proc = subprocess.run(
            [str(wandb_bin), "leet", "inspect", "--summary", "--json", str(log)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        theirs = json.loads(proc.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pytest.skip("wandb leet inspect is not available")
    ours, warnings = read_run_file(log)
    assert ours is not None and not warnings
    assert ours.config == theirs["config"] and ours.run_id == theirs["run_id"] and list(ours.tags) == theirs["tags"]
    public = {k: v for k, v in ours.summary.items() if not k.startswith("_")}
    assert public == {k: v for k, v in theirs["summary"].items() if not k.startswith("_")}
    cut = next((runs_dir / "main" / "wandb").glob("offline-run-*-nocut-p1")) / "run-nocut-p1.wandb"
    proc = subprocess.run([str(wandb_bin), "leet", "inspect", "--json", str(cut)], capture_output=True, text=True)
    assert len(read_log(cut).records) == len(proc.stdout.splitlines())


def test_framing_round_trip_and_damage(tmp_path: Path) -> None:
    records = [bytes([i % 251]) * (i * 977) for i in range(80)]  # many records span several 32 KiB blocks
    blob = encode_log(records)
    (tmp_path / "a.wandb").write_bytes(blob)
    assert read_log(tmp_path / "a.wandb").records == records
    for cut in (5, 7 + 3, 40_000, len(blob) - 1):
        (tmp_path / "b.wandb").write_bytes(blob[:cut])
        got = read_log(tmp_path / "b.wandb")
        assert got.problem and got.records == records[: len(got.records)]
    damaged = bytearray(blob)
    damaged[100] ^= 0xFF
    (tmp_path / "c.wandb").write_bytes(bytes(damaged))
    assert "checksum" in read_log(tmp_path / "c.wandb").problem


def test_dedup_prefers_finished_then_latest() -> None:
    t0 = datetime(2024, 1, 1, tzinfo=timezone.utc)

    def run(status: str | None, minutes: int, top1: float) -> RunInfo:
        summary = {"top1": top1, **({"status": status} if status else {})}
        return RunInfo(run_id="x", summary=summary, start_time=t0 + timedelta(minutes=minutes), source=str(minutes))

    kept, dropped = dedup([run("finished", 0, 1.0), run(None, 5, 2.0), run("finished", 3, 3.0), run("failed", 9, 4.0)])
    assert [r.summary["top1"] for r in kept] == [3.0] and len(dropped) == 3
    kept, _ = dedup([run("diverged", 0, 1.0), run(None, 5, 2.0), run("failed", 9, 4.0)])
    assert kept[0].summary["top1"] == 1.0


class _FakeRun:
    """Stands in for `wandb.apis.public.Run` (only the attributes the aggregator reads)."""

    def __init__(self, rid: str, ablation: str, seed: int, top1: float, status: str = "finished") -> None:
        self.id, self.name, self.group, self.tags = rid, rid, "table8", [ablation, "pretrain", "demo"]
        self.config = {
            "ablation": ablation,
            "stage": "pretrain",
            "seed": seed,
            "preset": "demo",
            "resolution": {"train_size": 224},
        }
        self.summary = {"status": status, "top1": top1}
        self.created_at = "2024-05-01T12:00:00Z"

    def scan_history(self, keys: list[str] | None = None, **kwargs: object) -> list[dict]:
        """Per-epoch rows as `Run.scan_history(keys=...)` yields them: only rows that have every key asked for."""
        rows = [{"_step": 10 * e, "epoch": e, "val/top1": self.summary["top1"] - 2 + e} for e in range(3)]
        return [r for r in rows if all(k in r for k in keys or [])]


class _FakeApi:
    """A stand-in for `wandb.Api`: no W&B server is reachable here, so the test records the query instead."""

    calls: list[tuple[str, dict]] = []

    def runs(self, path: str, filters: dict | None = None, **kwargs: object) -> list[_FakeRun]:
        self.calls.append((path, filters or {}))
        return [
            _FakeRun("a", "baseline", 0, 81.0),
            _FakeRun("b", "baseline", 1, 82.0),
            _FakeRun("c", "no_mixup", 0, 78.0),
            _FakeRun("d", "no_mixup", 1, 0.1, status="diverged"),
        ]


def test_api_source_with_stand_in(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`wandb://ENTITY/PROJECT` goes through `wandb.Api().runs(...)`; here `wandb.Api` is a stand-in (_FakeApi)."""
    import wandb

    monkeypatch.setattr(wandb, "Api", _FakeApi)
    _FakeApi.calls.clear()
    data, _ = _json(["wandb://me/deit", "--group", "table8", "--preset", "demo", "--since", "2024-01-01"], capsys)
    path, filters = _FakeApi.calls[0]
    assert path == "me/deit"
    assert {"group": {"$in": ["table8"]}} in filters["$and"] and {"config.preset": "demo"} in filters["$and"]
    assert any("createdAt" in f for f in filters["$and"])
    base, nomix = data["rows"][0]["cells"]["pretrain"], data["rows"][5]["cells"]["pretrain"]
    assert _close(base["mean"], 81.5) and _close(base["std"], SQRT_HALF) and base["n"] == 2
    assert _close(nomix["mean"], 78.0) and nomix["n"] == 1 and nomix["diverged"] == 1
    assert _close(nomix["delta"], -3.5) and _close(nomix["paper_delta"], -3.1)
    table = cli.aggregate(cli.build_parser().parse_args(["wandb://me/deit", "--curves", "x.png"]), lambda m: None)
    fig = plot_curves(table, None)  # the history through Run.scan_history, as offline logs have none here
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].lines}
    assert lines == {"baseline (n=2)": [79.5, 80.5, 81.5], "no_mixup (n=1, no spread)": [76.0, 77.0, 78.0]}


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert cli.main([str(tmp_path), "--where", "novalue"]) == 2
    assert cli.main([str(tmp_path), "--paper", "table99"]) == 2
    assert "unknown paper table" in capsys.readouterr().err


def test_sub_rows_name_plain_keys_when_no_group_option_differs() -> None:
    """Runs logged without group choices: a weight-decay override and a CNN run are their own rows."""

    def run(rid: str, seed: int, top1: float, wd: float = 0.05, model: str = "vit_demo") -> RunInfo:
        config = {"ablation": "baseline", "stage": "pretrain", "seed": seed, "run_id": rid, "data": {"root": rid},
                  "model": {"name": model}, "optimizer": {"weight_decay": wd}, "distill": {"type": "none"}}
        return RunInfo(run_id=rid, config=config, summary={"status": "finished", "top1": top1})

    runs = [run("a", 0, 50.0), run("b", 1, 52.0), run("c", 0, 40.0, wd=0.1), run("d", 0, 30.0, model="cnn_demo")]
    table = build_table(runs, rows="distill", paper="none")
    cells = {r.key: r.cells["pretrain"] for r in table.rows}
    assert list(cells) == ["none", "none · model.name=cnn_demo", "none · optimizer.weight_decay=0.1"]
    assert sorted(cells["none"].values) == [50.0, 52.0]
    assert cells["none · optimizer.weight_decay=0.1"].values == [40.0]  # data.root differs too: never a split
    assert table.splits[0].varied == ["model.name", "optimizer.weight_decay"]
    only = build_table(runs, rows="distill", paper="none", match_baseline=True)
    assert [r.key for r in only.rows] == ["none"] and {r.run_id for r in only.left_out} == {"c", "d"}


def test_rows_distill_keep_the_cnn_the_paper_preset_and_other_sizes_apart() -> None:
    """Configs as train.py composes them (with their group choices): the issue's `--rows distill` mix-up."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.conftest import CONF

    def run(rid: str, overrides: list[str], seed: int = 0) -> RunInfo:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
        config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
        config = {**config, "seed": seed, "run_id": rid, "choices": choices}
        return RunInfo(run_id=rid, config=config, summary={"status": "finished", "top1": 50.0 + seed})

    runs = [
        run("a", []),
        run("b", ["seed=1"], 1),
        run("paper", ["preset=paper"]),
        run("cnn", ["model=cnn_demo"]),
        run("ft48", ["stage=finetune"]),
        run("ft24", ["stage=finetune", "resolution=24px"]),  # Table 10's sweep: another size, its own row
    ]
    table = build_table(runs, rows="distill", paper="none")
    cells = {r.key: {s: sorted(c.run_ids) for s, c in r.cells.items() if c.run_ids} for r in table.rows}
    assert cells == {
        "none": {"pretrain": ["a", "b"], "finetune": ["ft48"]},
        "none · model=cnn_demo": {"pretrain": ["cnn"]},
        "none · preset=paper, data=imagenet, model=deit_base +1 more": {"pretrain": ["paper"]},
        "none · resolution=24px": {"finetune": ["ft24"]},
    }


def test_the_plain_run_keeps_the_row_name_over_smoke_runs_and_the_cnn_teacher() -> None:
    """A folder with the demo run, five `train.max_steps=3` smoke runs and the CNN teacher: the plain run is the
    row's main setting however many smoke runs there are; the others are sub-rows named by what they change."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.conftest import CONF

    def run(rid: str, overrides: list[str], seed: int = 0, top1: float = 60.0) -> RunInfo:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
        config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
        config = {**config, "seed": seed, "run_id": rid, "choices": choices}
        return RunInfo(run_id=rid, config=config, summary={"status": "finished", "top1": top1})

    smoke = [run(f"smoke{i}", ["train.max_steps=3", f"seed={i}"], seed=i, top1=10.0) for i in range(5)]
    runs = [run("demo", [], top1=63.9), *smoke, run("cnn", ["model=cnn_demo"], top1=70.0)]
    table = build_table(runs, rows="ablation", paper="none")
    cells = {r.key: sorted(r.cells["pretrain"].run_ids) for r in table.rows if r.cells["pretrain"].run_ids}
    assert cells == {
        "baseline": ["demo"],
        "baseline · model=cnn_demo": ["cnn"],
        "baseline · train.max_steps=3": [f"smoke{i}" for i in range(5)],
    }


# --- #26 point 11: seed noise beside every Δ -------------------------------------------------------------------


def _seeded(row: str, values: list[float], stage: str = "pretrain") -> list[RunInfo]:
    """One finished run per value (seeds 0, 1, ...) of an ablation row at a stage."""
    return [
        RunInfo(
            run_id=f"{row}-{stage}-{seed}",
            config={"ablation": row, "stage": stage, "seed": seed, "preset": "demo"},
            summary={"status": "finished", "top1": value},
        )
        for seed, value in enumerate(values)
    ]


# baseline [12, 14, 16, 18]: mean 15, s² = (9 + 1 + 1 + 9) / 3 = 20/3, n = 4
# no_mixup [11, 12, 13]: mean 12, s² = 1, n = 3; no_cutmix [5, 6, 7]: mean 6, s² = 1; ema [20]: n = 1
# dropout has fine-tune runs and the baseline none: no baseline to compare with
NOISY = [
    *_seeded("baseline", [12.0, 14.0, 16.0, 18.0]),
    *_seeded("no_mixup", [11.0, 12.0, 13.0]),
    *_seeded("no_cutmix", [5.0, 6.0, 7.0]),
    *_seeded("ema", [20.0]),
    *_seeded("dropout", [30.0, 31.0], stage="finetune"),
]
# Welch, no_mixup vs baseline (the same for no_cutmix; only the mean differs):
#   v1 = 1/3, v2 = (20/3)/4 = 5/3, se = sqrt(1/3 + 5/3) = sqrt(2) = 1.414214
#   ν = (v1 + v2)² / (v1²/(3-1) + v2²/(4-1)) = 4 / (1/18 + 25/27) = 4 / (53/54) = 216/53 = 4.075472
#   t_{0.975, 4.075472} = 2.756285 (between t_{0.975,5} = 2.571 and t_{0.975,4} = 2.776)
#   half width = 2.756285 * 1.414214 = 3.898020
#   no_mixup:  Δ = 12 - 15 = -3, CI [-6.898, +0.898]: contains 0
#   no_cutmix: Δ = 6 - 15 = -9,  CI [-12.898, -5.102]: does not
# Seeds per arm for the paper's Δ, n = 2 (z_0.975 + z_0.8)² s² / Δ_paper², 2 (1.959964 + 0.841621)² = 15.697759:
#   pooled s² = ((3-1)·1 + (4-1)·20/3) / (3 + 4 - 2) = 22/5 = 4.4
#   no_mixup:  paper Δ 78.7 - 81.8 = -3.1: 15.697759 · 4.4 / 9.61 = 7.19  -> 8
#   no_cutmix: paper Δ 80.0 - 81.8 = -1.8: 15.697759 · 4.4 / 3.24 = 21.32 -> 22
#   ema (n=1): pooled s² = (0 + 3 · 20/3) / 3 = 20/3; paper Δ +0.1: 15.697759 · (20/3) / 0.01 = 10465.2 -> 10466
T_WELCH = 2.756285
HALF = T_WELCH * math.sqrt(2.0)


def test_t_quantile_matches_the_tables() -> None:
    from deit_ablate.analysis.aggregate.stats import t_quantile, z_quantile

    tabulated = {1: 12.706, 2: 4.303, 3: 3.182, 5: 2.571, 10: 2.228, 30: 2.042, 100: 1.984}
    for df, t in tabulated.items():
        assert t_quantile(0.975, df) == pytest.approx(t, abs=5e-4), df
    assert t_quantile(0.9, 10) == pytest.approx(1.372, abs=5e-4)
    assert t_quantile(0.995, 2) == pytest.approx(9.925, abs=5e-4)
    assert t_quantile(0.025, 5) == pytest.approx(-2.571, abs=5e-4)  # symmetric
    assert t_quantile(0.975, 216 / 53) == pytest.approx(T_WELCH, abs=1e-5)  # Welch's fractional ν
    assert t_quantile(0.975, 1.5) == pytest.approx(6.016663, abs=1e-5)
    assert (z_quantile(0.975), z_quantile(0.8)) == pytest.approx((1.959964, 0.841621), abs=1e-6)
    # the quantile against a plain numerical integral of the t density (Simpson, 2000 panels) at a fractional ν
    df, x = 2.5, 1.7
    density = lambda u: math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2)) * (  # noqa: E731
        1 + u * u / df
    ) ** (-(df + 1) / 2)
    h = x / 2000
    simpson = h / 3 * sum((1 if i in (0, 2000) else 4 if i % 2 else 2) * density(i * h) for i in range(2001))
    assert t_quantile(0.5 + simpson, df) == pytest.approx(x, abs=1e-7)
    with pytest.raises(ValueError, match="0 < p < 1 and df > 0"):
        t_quantile(0.975, 0)


def test_welch_interval_by_hand() -> None:
    from deit_ablate.analysis.aggregate.stats import pooled_std, seeds_needed, welch

    ci = welch([1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0])
    # Δ = 2 - 5 = -3; s1² = 1, s2² = (9 + 1 + 1 + 9)/3 = 20/3; v1 = 1/3, v2 = 5/3; se = sqrt(2)
    # ν = 4 / ((1/3)²/2 + (5/3)²/3) = 216/53 = 4.0755; CI = -3 ± 2.756285 · 1.414214 = [-6.898, +0.898]
    assert ci.delta == pytest.approx(-3.0) and ci.se == pytest.approx(math.sqrt(2.0))
    assert ci.df == pytest.approx(216 / 53)
    assert (ci.low, ci.high) == (pytest.approx(-3.0 - HALF, abs=1e-5), pytest.approx(-3.0 + HALF, abs=1e-5))
    assert ci.contains_zero is True and ci.why == ""
    assert welch([10.0, 11.0, 12.0], [2.0, 4.0, 6.0, 8.0]).contains_zero is False  # Δ = +6 > 3.898
    # pooled s² = (2·1 + 3·20/3) / 5 = 4.4; for a paper Δ of 2.2: 15.697759 · 4.4 / 4.84 = 14.27 seeds per arm
    assert pooled_std([1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0]) == pytest.approx(math.sqrt(4.4))
    assert seeds_needed(math.sqrt(4.4), -2.2) == pytest.approx(14.2707, abs=1e-3)
    assert seeds_needed(2.0, 2.0) == pytest.approx(15.6978, abs=1e-3)  # 2 (z_.975 + z_.8)²


def test_welch_edge_cases() -> None:
    from deit_ablate.analysis.aggregate.stats import pooled_std, seeds_needed, welch

    one = welch([5.0], [2.0, 4.0, 6.0, 8.0])  # n=1: a difference, no interval
    assert one.delta == pytest.approx(0.0) and one.low is None and one.high is None
    assert one.why == "n=1, no spread" and one.contains_zero is None
    assert welch([5.0, 6.0], [5.0]).why == "n=1, no spread"
    flat = welch([3.0, 3.0], [1.0, 1.0, 1.0])  # equal values in both arms: s = 0, ν undefined
    assert flat.delta == pytest.approx(2.0) and flat.low is None and flat.why == "s=0, no spread"
    # one arm without spread: ν = n - 1 of the other arm; v2 = (20/3)/4 = 5/3, se = sqrt(5/3)
    half = 3.182446 * math.sqrt(5 / 3)  # t_{0.975, 3}
    ci = welch([5.0, 5.0], [2.0, 4.0, 6.0, 8.0])
    assert ci.df == pytest.approx(3.0) and ci.high == pytest.approx(half, abs=1e-5)
    assert welch([5.0], []) is None and welch([], [1.0, 2.0]) is None  # a missing arm: nothing to compare
    assert pooled_std([1.0], [2.0]) is None and pooled_std([3.0, 3.0], [3.0]) == 0.0
    assert seeds_needed(0.0, 1.0) == 0.0 and seeds_needed(1.0, 0.0) is None


def _noisy_table():
    return build_table(list(NOISY), rows="ablation", paper="table8")


def test_table_gives_each_delta_an_interval_a_marker_and_the_seeds_needed() -> None:
    table = _noisy_table()
    cells = {r.key: r.cells for r in table.rows}
    mix = cells["no_mixup"]["pretrain"]
    assert (mix.ci.low, mix.ci.high) == (pytest.approx(-3 - HALF, abs=1e-5), pytest.approx(-3 + HALF, abs=1e-5))
    assert mix.seeds_needed == 8 and cells["no_cutmix"]["pretrain"].seeds_needed == 22
    assert cells["ema"]["pretrain"].seeds_needed == 10466
    lines = {line.split(" | ")[0].strip("| "): line for line in render(table, "markdown").splitlines()}
    head = next(line for line in lines.values() if line.startswith("| ablation"))
    assert "| ours pre-train | Δ | paper @224 | paper Δ | Δ 95% CI | seeds/arm |" in head
    assert "| 12.00 ± 1.00 (n=3) | -3.00 ○ | 78.7 | -3.1 | [-6.90, +0.90] | 8 |" in lines["no_mixup"]
    assert "| 6.00 ± 1.00 (n=3) | -9.00 | 80.0 | -1.8 | [-12.90, -5.10] | 22 |" in lines["no_cutmix"]
    assert "| 20.00 (n=1) | +5.00 | 81.9 | +0.1 | n=1, no spread | 10466 |" in lines["ema"]
    assert "| 30.50 ± 0.71 (n=2) |  | 83.1 | +0.0 | no baseline |" in lines["dropout"]
    assert lines["baseline"].startswith("| baseline | 15.00 ± 2.58 (n=4) | +0.00 | 81.8 ± 0.2 | +0.0 |  |  |")
    text = render(table, "markdown")
    assert "○ the 95% interval contains 0: this Δ cannot be told from zero" in text
    assert "n ≈ 2·(z_0.975 + z_0.8)²·s²/Δ_paper²" in text
    page = to_html(table, 2, [])
    assert "<td>-3.00 ○</td>" in page and "<td>[-6.90, +0.90]</td>" in page and "<td>n=1, no spread</td>" in page
    assert "cannot be told from zero" in page
    rows = {r["key"]: r["cells"] for r in json.loads(render(table, "json"))["rows"]}
    rec = rows["no_mixup"]["pretrain"]
    assert rec["ci_low"] == pytest.approx(-3 - HALF, abs=1e-5) and rec["ci_contains_zero"] is True
    assert rec["ci_df"] == pytest.approx(216 / 53) and rec["seeds_needed"] == 8
    csv_row = next(r for r in csv.DictReader(io.StringIO(render(table, "csv"))) if r["row"] == "ema")
    assert csv_row["pretrain_ci_note"] == "n=1, no spread" and csv_row["pretrain_ci_low"] == ""


def test_delta_plot_carries_error_bars_markers_and_n() -> None:
    from matplotlib.container import BarContainer, ErrorbarContainer

    table = _noisy_table()
    ax = draw_deltas(table).axes[0]  # horizontal bars: a row's name level on the y axis, Δ along x
    keys = [t.get_text() for t in ax.get_yticklabels()]
    ours = next(c for c in ax.containers if isinstance(c, BarContainer) and c.get_label() == "ours, pre-train")
    y = {key: bar.get_y() + bar.get_height() / 2 for key, bar in zip(keys, ours.patches, strict=True)}
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert bars and "95% CI" in bars[0].get_label()
    lines = [s for c in bars for s in c.lines[2][0].get_segments()]  # one horizontal segment per error bar
    segments = {round(float(s[0][1]), 6): (float(s[0][0]), float(s[1][0])) for s in lines}
    for key, delta in (("no_mixup", -3.0), ("no_cutmix", -9.0)):
        want = (pytest.approx(delta - HALF, abs=1e-5), pytest.approx(delta + HALF, abs=1e-5))
        assert segments[round(y[key], 6)] == want, key
    assert round(y["ema"], 6) not in segments  # n=1: no error bar
    zero = next(line for line in ax.lines if "cannot be told from zero" in line.get_label())
    assert [round(float(v), 6) for v in zero.get_ydata()] == [round(y["no_mixup"], 6)]
    assert list(zero.get_xdata()) == [pytest.approx(-3.0)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("95% CI" in t for t in legend) and any("cannot be told from zero" in t for t in legend)
    texts = {t.get_text() for t in ax.texts}
    assert "n=3 vs 4" in texts and "n=1, no spread" in texts
    assert all(t.get_rotation() == 0 for t in [*ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels()])


# --- #26 point 12: every output says what was run --------------------------------------------------------------


def _described(rid: str, seed: int, depth: int = 1, digest: str = "4a7852e162e65685", stage: str = "pretrain"):
    config = {"ablation": "baseline", "stage": stage, "seed": seed, "preset": "demo",
              "model": {"name": "deit_tiny_patch16_224", "kwargs": {"patch_size": 8, "depth": depth}},
              "data": {"name": "builtin", "num_classes": 10}, "data_fingerprint": {"digest": digest},
              "train": {"epochs": 2}, "finetune": {"epochs": 3},
              "resolution": {"train_size": 32 if stage == "pretrain" else 48, "eval_size": 32 if stage == "pretrain"
                             else 48}}
    return RunInfo(run_id=rid, config=config, summary={"status": "finished", "top1": 50.0 + seed})


def test_what_was_run_names_each_setting_and_lists_values_that_differ() -> None:
    from deit_ablate.analysis.aggregate.about import facts

    same = build_table([_described("a", 0), _described("b", 1), _described("f", 0, stage="finetune")])
    got = dict(facts(same))
    assert got["data"] == "builtin: 10 synthetic shape classes (digest 4a7852e1, 10 classes)"
    assert got["model"] == "deit_tiny_patch16_224 (patch_size=8, depth=1)"
    assert got["epochs"] == "pre-train 2; fine-tune 3" and got["resolution"] == "pre-train 32 px; fine-tune 48 px"
    assert got["preset"] == "demo" and got["commit"] == "not recorded"
    mixed = build_table([_described("a", 0), _described("b", 1, depth=2, digest="ffffffff00000000")])
    got = dict(facts(mixed))
    assert got["model"] == ("differs: deit_tiny_patch16_224 (patch_size=8, depth=1) (1 run) | "
                            "deit_tiny_patch16_224 (patch_size=8, depth=2) (1 run)")
    shapes = "builtin: 10 synthetic shape classes (digest"
    assert got["data"].startswith(f"differs: {shapes} 4a7852e1, 10 classes) (1 run) | {shapes} ffffffff")
    text = render(mixed, "markdown")
    assert "model: differs: deit_tiny_patch16_224 (patch_size=8, depth=1) (1 run)" in text


def test_reader_reads_the_commit_of_a_run_logged_in_a_repository(tmp_path: Path) -> None:
    """wandb records `git.commit` in the run record when a run is not started with disable_git (ours are)."""
    from wandb.proto.wandb_internal_pb2 import Record

    from deit_ablate.analysis.aggregate.about import facts

    record = Record()
    record.run.run_id = "c0"
    record.run.git.commit = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / "run-c0.wandb").write_bytes(encode_log([record.SerializeToString()]))
    info, _ = read_run_file(tmp_path / "run-c0.wandb")
    assert info is not None and info.commit == "0123456789abcdef0123456789abcdef01234567"
    run = _described("c0", 0)
    run.commit = info.commit
    assert dict(facts(build_table([run, _described("c1", 1)])))["commit"] == (
        "differs: 0123456789ab (1 run) | not recorded (1 run)"
    )


def test_only_present_keeps_the_fine_tune_column_when_fine_tunes_ran(
    runs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = _json([str(runs_dir / "main" / "wandb"), *TABLE8, "--only-present"], capsys)
    assert data["stages"] == ["pretrain", "finetune"]
    assert [r["key"] for r in data["rows"]] == ["baseline", "sgd", "autoaugment", "no_mixup", "no_cutmix",
                                                "no_erasing", "ema"]
    table = build_table([_described("a", 0)], only_present=True)  # no fine-tune run: its column goes
    assert table.stages == ["pretrain"] and "fine-tune" not in render(table, "markdown")


def test_a_teacher_named_for_a_run_that_does_not_distil_never_splits_its_cell():
    from deit_ablate.analysis.aggregate.settings import experiment_settings

    plain = {"preset": "demo", "distill": {"type": "none", "teacher": {"model": "resnet10t", "checkpoint": None}}}
    swept = {"preset": "demo", "distill": {"type": "none", "teacher": {"model": "resnet10t", "checkpoint": "/x/t.pt"}}}
    assert experiment_settings(swept) == experiment_settings(plain)
    distilled = [{**config, "distill": {**config["distill"], "type": "hard"}} for config in (plain, swept)]
    assert experiment_settings(distilled[0]) != experiment_settings(distilled[1])


# --- #46 point 15: a label with dollar signs is drawn as it is, not read as mathtext ---------------------------------


def _drawn_as(text) -> str:
    """What matplotlib puts on the page for a Text: its string once `\\$` escapes are undone, or MATH if it would
    be parsed as mathtext (which raises on `$x^$` and draws `$x$` as an italic x)."""
    shown, math_mode = text._preprocess_math(text.get_text())
    return "MATH" if math_mode else shown


def test_labels_with_dollar_signs_draw_literally_in_plot_curves_and_html(tmp_path: Path) -> None:
    import numpy as np
    from matplotlib.text import Text

    from deit_ablate.analysis.aggregate.disagree import heatmap
    from deit_ablate.analysis.aggregate.plot import figure_png

    rows = {"baseline": (50.0, 52.0), "$x^$": (40.0, 41.0), "$x$": (45.0, 46.0)}
    runs = [_run(f"d{i}-{seed}", row, "pretrain", seed, _done(value), group="dollars$")
            for i, (row, values) in enumerate(rows.items()) for seed, value in enumerate(values)]
    write_offline_runs(runs, tmp_path)
    plot, curves, page = tmp_path / "delta.png", tmp_path / "curves.png", tmp_path / "page.html"
    argv = [str(tmp_path / "main" / "wandb"), "--group", "dollars$", "--baseline", "baseline", "-q"]
    assert cli.main([*argv, "--plot", str(plot), "--curves", str(curves), "--out", str(tmp_path / "t.md")]) == 0
    assert plot.stat().st_size > 0 and curves.stat().st_size > 0
    assert cli.main([*argv, "--format", "html", "--out", str(page)]) == 0
    html = page.read_text()
    assert "<td>$x^$</td>" in html and "<td>$x$</td>" in html and html.count('src="data:image/png') == 2

    args = cli.build_parser().parse_args([*argv, "--plot", str(plot), "--curves", str(curves)])
    figs = cli.figures(cli.aggregate(args, lambda m: None), args)
    for name, fig in figs.items():
        figure_png(fig)  # draws every text (tick labels included) as the PNG does
        drawn = [_drawn_as(t) for t in fig.findobj(Text) if "x" in t.get_text() and "$" in t.get_text()]
        assert "MATH" not in drawn and {"$x^$", "$x$"} <= {d.split(" ")[0] for d in drawn}, (name, drawn)
    fig = heatmap(["$a$", "b"], np.array([[0.0, 1.0], [1.0, 0.0]]), [{"pair": "$a$ vs b", "paper": 1.0,
                                                                      "ours": 0.01}], 10, why="cost $5$")
    figure_png(fig)
    assert "MATH" not in [_drawn_as(t) for t in fig.findobj(Text)]
