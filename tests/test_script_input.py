"""The scripts take bad input as the commands do (issue 52, point 9): scripts/bench.py with a batch of -4, a GPU
that is not there, a report that cannot be written; scripts/docs_numbers.py with no runs under --outputs or a damaged
docs/measured.json: one line naming the problem and the fix, exit status 2, and no report or page written."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def script(name: str):
    """scripts/<name>.py as a module (a script, not part of the package)."""
    key = f"{name}_script_under_test"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def refused(call, capsys) -> str:
    """The one error line `call` ends with, exit status 2."""
    capsys.readouterr()
    try:
        status = call()
    except SystemExit as stop:
        status = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, (status, err)
    return lines[0]


def bench_refuses(args: list[str], out: Path, capsys) -> str:
    line = refused(lambda: script("bench").main(["--quick", "--skip-timm", "--sections", "matmul", "--out", str(out),
                                                 *args]), capsys)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*")), "a partial report was written"
    return line


@pytest.mark.parametrize(("flag", "value"), [("--batch", "-4"), ("--batch", "0"), ("--repeats", "nan"),
                                             ("--workers", "-1"), ("--run-size", "x"), ("--device", "tpu")])
def test_a_bench_option_out_of_range_is_one_line(flag, value, tmp_path, capsys):
    line = bench_refuses([flag, value], tmp_path / "bench.json", capsys)
    assert line.startswith(f"error: argument {flag}: ") and "--help" in line, line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
def test_bench_on_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    line = bench_refuses(["--device", "cuda"], tmp_path / "bench.json", capsys)
    assert "--device cuda: no GPU" in line and "--device cpu" in line, line


def test_a_bench_report_where_no_folder_is_is_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    line = bench_refuses([], tmp_path / "a-file" / "bench.json", capsys)
    assert "is a file, not a folder" in line, line
    line = bench_refuses([], tmp_path / "missing" / "bench.json", capsys)
    assert "does not exist" in line, line
    line = refused(lambda: script("bench").main(["--quick", "--skip-timm", "--out", str(tmp_path)]), capsys)
    assert f"--out {tmp_path} is a folder" in line, line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder of mode 555")
def test_a_bench_report_in_a_read_only_folder_is_one_line(tmp_path, capsys):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    try:
        line = bench_refuses([], folder / "bench.json", capsys)
    finally:
        folder.chmod(0o755)
    assert "cannot be written" in line and "not writable" in line, line


def test_a_bench_report_on_a_file_system_root_cannot_write_is_one_line(tmp_path, capsys):
    """/proc refuses new files whatever the user (root included, where the permission bits say it may)."""
    line = bench_refuses([], Path("/proc/bench.json"), capsys)
    assert "cannot be written" in line, line


@pytest.fixture
def measured_copy(tmp_path, monkeypatch):
    """docs_numbers writing its figures to a copy of docs/measured.json; the pages' texts before, to compare."""
    docs_numbers = script("docs_numbers")
    copy = tmp_path / "measured.json"
    copy.write_text(docs_numbers.MEASURED.read_text())
    monkeypatch.setattr(docs_numbers, "MEASURED", copy)
    pages = {page.file: (REPO / page.file).read_text() for page in docs_numbers.PAGES.values()}
    yield copy
    assert {file: (REPO / file).read_text() for file in pages} == pages, "a page was rewritten"


def test_docs_numbers_without_a_wandb_folder_is_one_line(measured_copy, tmp_path, capsys):
    before = measured_copy.read_text()
    line = refused(lambda: script("docs_numbers").main(["--no-train", "--outputs", str(tmp_path / "none")]), capsys)
    assert "holds no wandb/ folder" in line and "without --no-train" in line, line
    assert measured_copy.read_text() == before


@pytest.mark.parametrize("damage", [b"{\"transfer\": {\"top1\": ", b"\xff\xfe garbage", b"[1, 2]", b"{\"transfer\": 3}",
                                    b"{\"transfer\": {}}", b"{}"],
                         ids=["cut_short", "binary", "a_list", "a_number", "figures_missing", "page_missing"])
def test_docs_numbers_with_a_damaged_measured_json_is_one_line(measured_copy, capsys, damage):
    measured_copy.write_bytes(damage)
    line = refused(lambda: script("docs_numbers").main(["--render-only", "--pages", "transfer"]), capsys)
    assert line.startswith("error: docs_numbers: ") and "measured.json" in line, line
    assert "git checkout" in line or "python scripts/docs_numbers.py --pages transfer" in line, line
    assert measured_copy.read_bytes() == damage
