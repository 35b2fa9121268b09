"""A launch that cannot work stops before anything is written (issue 26, points 7-9): online tracking without a key
or a server, an output root that cannot hold the run, a refused key; and a dry run leaves every file as it was."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deit_ablate.record.rundir import HYDRA, HYDRA_CONFIG, MULTIRUN, RUNS, wandb_root
from tests.conftest import TINY, compose_config, run_train

ONE_STEP = TINY + ["train.max_steps=1", "train.micro_batch=16"]  # the one_step_run fixture's run
DUMMY_KEY = "0123456789abcdef" * 2 + "01234567"  # 40 characters, the length of a wandb API key


def _one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """The single `error: ...` line of a refused launch (exit status 2, no traceback), holding `expected`."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _tree(root: Path) -> dict[str, str]:
    """Every path under `root` with a digest of its content (folders and links as such)."""
    if not root.exists():
        return {}
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = f"link {path.readlink()}"
        elif path.is_dir():
            out[key] = "folder"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _no_credentials(home: Path) -> dict[str, str]:
    """An environment where wandb finds no key: an empty home (no ~/.netrc, no settings) and no key variables."""
    home.mkdir(exist_ok=True)
    return {"HOME": str(home), "WANDB_API_KEY": "", "NETRC": "", "WANDB_IDENTITY_TOKEN_FILE": "",
            "WANDB_CONFIG_DIR": ""}


@pytest.fixture
def read_only_mount():
    """Mount a small read-only tmpfs at a given folder (root can write through chmod, not through `ro`)."""
    mounted = []

    def mount(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here ({proc.stderr.strip() or proc.returncode}); needs root "
                        "and CAP_SYS_ADMIN, as CI has")
        mounted.append(folder)
        return folder

    try:
        yield mount
    finally:
        for folder in reversed(mounted):
            subprocess.run(["umount", str(folder)], check=False)


# --- 7. runtime.tracking.mode=online without a key or a server ------------------------------------------------------

def test_online_tracking_without_an_api_key_is_one_line_and_writes_nothing(tmp_path, data_cache):
    started = time.monotonic()
    proc = run_train(ONE_STEP + ["runtime.tracking.mode=online"], tmp_path, data_cache, check=False,
                     extra_env=_no_credentials(tmp_path / "home"))
    _one_line_error(proc, "runtime.tracking.mode=online", "API key", "wandb login",
                    "runtime.tracking.mode=offline", "wandb sync")
    assert not (tmp_path / "outputs").exists()
    assert time.monotonic() - started < 60


def test_online_tracking_with_a_key_but_no_server_is_one_line_within_seconds(tmp_path, data_cache):
    started = time.monotonic()
    proc = run_train(ONE_STEP + ["runtime.tracking.mode=online"], tmp_path, data_cache, check=False,
                     extra_env={**_no_credentials(tmp_path / "home"), "WANDB_API_KEY": DUMMY_KEY})
    _one_line_error(proc, "runtime.tracking.mode=online", "cannot reach the wandb server",
                    "runtime.tracking.mode=offline", "wandb sync")
    assert not (tmp_path / "outputs").exists()
    assert time.monotonic() - started < 60  # wandb itself gave up after 18-106 s


def test_the_server_check_finds_a_listening_server_and_is_bounded(monkeypatch):
    from deit_ablate.record.tracking import server_problem

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert server_problem(f"http://127.0.0.1:{port}", timeout=3.0) is None
    assert "Connection refused" in server_problem(f"http://127.0.0.1:{port}", timeout=3.0)  # closed now
    assert "Name or service not known" in server_problem("https://no-such-host.invalid", timeout=3.0)

    def hang(*args, **kwargs):  # a name lookup that hangs (socket timeouts do not cover it)
        time.sleep(2)
        raise OSError("too late")

    monkeypatch.setattr(socket, "create_connection", hang)
    started = time.monotonic()
    assert server_problem("https://api.wandb.example", timeout=0.5) == "api.wandb.example:443: no answer within 0.5 s"
    assert time.monotonic() - started < 2.0


def test_offline_and_disabled_tracking_never_look_for_a_key_or_a_server(monkeypatch):
    from deit_ablate.record import tracking

    def fail(*args, **kwargs):
        raise AssertionError("an offline or disabled run looked for wandb's key or server")

    monkeypatch.setattr(tracking, "wandb_server", fail)
    monkeypatch.setattr(tracking, "server_problem", fail)
    for mode in ("offline", "disabled"):
        tracking.check_tracking(compose_config([f"runtime.tracking.mode={mode}"]).runtime)


def test_a_netrc_entry_for_the_server_is_a_key(tmp_path, monkeypatch):
    from urllib.parse import urlsplit

    from deit_ablate.record.tracking import has_wandb_key, wandb_server

    for key, value in _no_credentials(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    server = wandb_server()
    assert not has_wandb_key(server)
    (tmp_path / "home" / ".netrc").write_text(f"machine {urlsplit(server).netloc}\n  login user\n"
                                              f"  password {DUMMY_KEY}\n")
    assert has_wandb_key(server)


# --- 8. an output root that cannot hold the run ---------------------------------------------------------------------

def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


@pytest.mark.parametrize(("case", "expected"), [
    ("file", "is a file, not a folder"),
    ("under_a_file", "is a file, not a folder"),
    ("read_only", "read-only file system"),
    ("wandb_read_only", "read-only file system"),
])
def test_an_output_root_that_cannot_hold_the_run_is_one_line_and_nothing_is_written(tmp_path, data_cache,
                                                                                   read_only_mount, case, expected):
    if case == "file":
        root = _a_file(tmp_path)
    elif case == "under_a_file":
        root = _a_file(tmp_path) / "sub"
    elif case == "read_only":
        root = read_only_mount(tmp_path / "ro")
    else:
        root = tmp_path / "out"
        read_only_mount(wandb_root(root))
    before = _tree(tmp_path)
    proc = run_train(ONE_STEP + [f"runtime.output_root={root}"], tmp_path, data_cache, check=False)
    line = _one_line_error(proc, expected, "runtime.output_root")
    assert str(wandb_root(root) if case == "wandb_read_only" else root) in line
    assert _tree(tmp_path) == before


def test_a_read_only_wandb_folder_is_fine_when_tracking_is_disabled(tmp_path, read_only_mount):
    from deit_ablate.core.errors import ConfigError
    from deit_ablate.record.rundir import check_output_root

    read_only_mount(wandb_root(tmp_path))
    check_output_root(tmp_path, tracking=False)
    with pytest.raises(ConfigError, match="runtime.tracking.mode=disabled"):
        check_output_root(tmp_path, tracking=True)


# --- 9. refusals and the dry run leave nothing ----------------------------------------------------------------------

@pytest.mark.parametrize("sweep", [[], ["-m", "seed=0,1"]])
def test_a_refused_launch_leaves_nothing(tmp_path, data_cache, sweep):
    proc = run_train(sweep + ONE_STEP + ["+mix.mixup_alpah=1"], tmp_path, data_cache, check=False)
    _one_line_error(proc, "mix.mixup_alpah is not a setting", "Did you mean mix.mixup_alpha")
    assert not (tmp_path / "outputs").exists(), _tree(tmp_path / "outputs")


def _plan(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(line.split("): ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[dry run]"))


@pytest.mark.slow
def test_a_dry_run_leaves_every_file_under_the_output_root_as_it_was(tmp_path, data_cache, one_step_run):
    outputs = one_step_run.copy_into(tmp_path)  # `-m seed=0` + ONE_STEP: a finished run, and the sweep's multirun.yaml
    before = _tree(outputs)
    assert any(key.endswith(f"{HYDRA}/{HYDRA_CONFIG}") for key in before) and f"{RUNS}/{MULTIRUN}" in before
    dry = ONE_STEP + ["runtime.dry_run=true"]
    slurm = ["hydra/launcher=slurm_8gpu", "hydra.launcher.cpus_per_task=2", "hydra.launcher.tasks_per_node=2"]
    for args, plan in [(["seed=0"], ["skip (already finished)"]),
                       (["seed=1"], ["train from step 0"]),
                       (["-m", "seed=0,1"], ["skip (already finished)", "train from step 0"]),
                       (["-m", "seed=0,1"] + slurm, ["skip (already finished)", "train from step 0"])]:
        proc = run_train(args + dry, tmp_path, data_cache)
        assert _plan(proc) == plan, proc.stdout
        assert _tree(outputs) == before, args  # nothing new, nothing changed
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert _plan(run_train(["-m", "seed=0,1"] + dry, fresh, data_cache)) == ["train from step 0"] * 2
    assert not list(fresh.iterdir())  # not even an output root
