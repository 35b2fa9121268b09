"""wandb logging from rank 0: offline by default into <output_root>/wandb, one wandb run per training run.

Rank 0 also keeps the per-epoch metrics as `metrics.csv` in the run folder (with or without wandb), and the
wandb config carries Hydra's group choices (`choices`: `mix: cutmix_only`, ...) beside the resolved config.
"""

from __future__ import annotations

import csv
import functools
import io
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omegaconf import DictConfig, OmegaConf

from deit_ablate.config.keys import LEGACY_CHOICE_KEYS, legacy_keys
from deit_ablate.config.schema import RuntimeConfig
from deit_ablate.config.studies import study_names
from deit_ablate.core.atomic import write_text_atomic
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.identity import RunIdentity
from deit_ablate.record.rundir import METRICS, wandb_root
from deit_ablate.record.runfiles import DamagedRecord, read_text, removal

# Keys of the resolved config that never go to wandb (they could carry credentials or host details).
_PRIVATE_KEYS = ("runtime.tracking.entity",)
METRICS_CSV = METRICS

# How often wandb's service writes what it holds into the run's .wandb file (wandb's default, 15 s, left a launch
# killed within 15 s of its start a 7-byte log): a kill of the process group loses the last second of its mirror of
# metrics.csv, which keeps every epoch row (written atomically as logged).
WANDB_FLUSH_S = 1.0

# How long an online run's start waits for the wandb server to accept a connection.
CONNECT_TIMEOUT_S = 4.0


def quiet_wandb() -> None:
    """wandb prints nothing of its own; set before wandb first reads the environment, which it reads only once."""
    os.environ.setdefault("WANDB_SILENT", "true")


def wandb_server() -> str:
    """The server an online run logs to, as wandb finds it (WANDB_BASE_URL, `wandb login --host`, its default)."""
    quiet_wandb()
    from wandb.sdk import wandb_setup

    return wandb_setup.singleton().settings.base_url


def has_wandb_key(server: str) -> bool:
    """Whether wandb finds a key for `server` without asking: WANDB_API_KEY (or WANDB_IDENTITY_TOKEN_FILE), the
    server's entry in ~/.netrc (or $NETRC), its settings."""
    from wandb.sdk.lib import wbauth

    found = wbauth.authenticate_session(host=server, source="deit-ablate", prompt=False, update_session=False)
    return found is not None


def server_problem(url: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why no TCP connection to `url`'s server (or to the proxy the environment names for it) opens within `timeout`
    seconds, name lookup included; None when one does."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxy_parts.hostname or "", proxy_parts.port or 80
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(f"{host}:{port}: {error.strerror or error}")

    # a daemon thread, because the name lookup itself has no timeout
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"{host}:{port}: no answer within {timeout:g} s"


def check_tracking(runtime: RuntimeConfig) -> None:
    """runtime.tracking.mode=online needs a wandb key and a server that answers: a ConfigError naming the offline
    way, before anything starts (wandb itself fails after 18-106 s with a long traceback). Other modes: nothing."""
    if runtime.tracking.mode != "online":
        return
    offline = (f"or log offline with runtime.tracking.mode=offline and upload later with "
               f"`wandb sync {wandb_root(runtime.output_root)}/offline-run-*`.")
    server = wandb_server()
    from wandb.errors import AuthenticationError

    try:
        found = has_wandb_key(server)
    except AuthenticationError as error:
        raise ConfigError(f"runtime.tracking.mode=online: wandb cannot use its key ({error}). Fix the key, "
                          f"{offline}") from None
    if not found:
        raise ConfigError(f"runtime.tracking.mode=online needs a wandb API key for {server}, and none is set (no "
                          f"WANDB_API_KEY, no entry for {urlsplit(server).hostname} in ~/.netrc). Run `wandb login` "
                          f"(or set WANDB_API_KEY), {offline}")
    problem = server_problem(server)
    if problem is not None:
        raise ConfigError(f"runtime.tracking.mode=online cannot reach the wandb server {server} ({problem}). Check the "
                          f"network (a proxy goes in HTTPS_PROXY, another server in WANDB_BASE_URL), {offline}")


def loggable_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as a plain dict, without private keys."""
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for dotted in _PRIVATE_KEYS:
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return config


def run_tags(choices: dict[str, str], stage: str, preset: str) -> list[str]:
    """A run's wandb tags: Table 8's row (bare, as before it became a choice), the stage and the scale, and each
    other study's row it has as `<study>=<row>`."""
    others = [f"{s}={choices[s]}" for s in study_names() if s in choices and s not in LEGACY_CHOICE_KEYS]
    return [*legacy_keys(choices).values(), stage, preset, *others]


def hydra_choices() -> dict[str, str]:
    """The config-group options of the running Hydra job (`mix: cutmix_only`), without Hydra's own groups."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    choices = OmegaConf.to_container(HydraConfig.get().runtime.choices, resolve=True)
    return {str(k): str(v) for k, v in choices.items() if not str(k).startswith("hydra/") and v is not None}


def hydra_run_dir() -> Path | None:
    """The running Hydra job's folder, or None outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def write_epoch_row(path: Path, row: dict[str, Any]) -> None:
    """Add one epoch's metrics to a CSV; rows of this epoch and later (from before a resume) are replaced."""
    kept: list[dict[str, str]] = []
    fields: list[str] = []
    text = metrics_text(path)
    if text is not None:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        fields = list(reader.fieldnames or [])
        kept = [r for r in reader if r.get("epoch", "").isdigit() and int(r["epoch"]) < int(row["epoch"])]
    fields += [k for k in row if k not in fields]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n", restval="")
    writer.writeheader()
    writer.writerows(kept)
    writer.writerow(row)
    write_text_atomic(path, buf.getvalue())


@functools.cache
def code_commit() -> str | None:
    """The git commit of the code running (`+dirty` with uncommitted changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def wandb_logs(output_root: str | Path, run_id: str) -> list[Path]:
    """The wandb folders (offline or online) holding a log of run `run_id` under `<output_root>/wandb`."""
    root = wandb_root(output_root)
    found = sorted(root.glob(f"*-{run_id}")) if root.is_dir() else []
    return [folder for folder in found if any(folder.glob("*.wandb"))]


def metrics_text(path: Path) -> str | None:
    """A run's metrics.csv, or None where it has none; a DamagedRecord naming the fix when it is no text file."""
    try:
        return read_text(path)
    except FileNotFoundError:
        return None
    except DamagedRecord as error:
        raise DamagedRecord(path, error.problem, f"Delete it ({removal(path)}) to go on without the epochs it held "
                            "(wandb then gets the run's result without them), or move the run folder away to train "
                            "the run again") from None


def read_epoch_rows(path: Path) -> list[dict[str, Any]]:
    """The per-epoch rows of a metrics.csv, numbers as numbers (empty when it is missing)."""
    text = metrics_text(path)
    if text is None:
        return []
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    return [{key: _number(value) for key, value in row.items() if value != ""} for row in rows]


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


_LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"  # where W&B Launch stages a job's inputs before wandb.init


def skip_unstaged_launch_inputs(wandb_module: Any) -> None:
    """Spare wandb.init the ~1 s import of W&B Launch it makes to apply staged job inputs when none can exist.

    wandb.init ends by importing wandb.sdk.launch (and wandb.apis.public with it) only to apply the inputs a W&B
    Launch job staged beforehand; staging them imports the module that holds them, so while that module is not
    loaded there is nothing to apply, and the import is skipped. Once it is loaded, wandb's own method runs. A
    wandb without the method is left as it is."""
    run_class = getattr(getattr(wandb_module, "sdk", None), "wandb_run", None)
    run_class = getattr(run_class, "Run", None)
    original = getattr(run_class, "_detect_and_apply_job_inputs", None)
    if original is None or getattr(original, "skips_unstaged", False):
        return

    @functools.wraps(original)
    def detect_and_apply(self: Any) -> None:
        if _LAUNCH_INPUTS in sys.modules:
            original(self)

    detect_and_apply.skips_unstaged = True  # type: ignore[attr-defined]
    run_class._detect_and_apply_job_inputs = detect_and_apply


class Tracker:
    """A wandb run on rank 0 and a silent stand-in elsewhere; rank 0 also writes `metrics.csv`."""

    def __init__(self, cfg: DictConfig, identity: RunIdentity, data: dict[str, Any], enabled: bool,
                 run_dir: Path | None = None, write_csv: bool = True) -> None:
        self.run = None
        self.csv_path = None
        if not enabled:
            return
        folder = run_dir if run_dir is not None else hydra_run_dir()
        self.csv_path = folder / METRICS_CSV if folder is not None and write_csv else None
        if cfg.runtime.tracking.mode == "disabled":
            return
        import wandb

        skip_unstaged_launch_inputs(wandb)
        wandb_dir = Path(cfg.runtime.output_root).resolve()
        wandb_dir.mkdir(parents=True, exist_ok=True)
        quiet_wandb()
        choices = hydra_choices()
        config = {**loggable_config(cfg), **legacy_keys(choices), "run_id": identity.run_id,
                  "run_name": identity.name, "experiment_digest": identity.digest, "data_fingerprint": data,
                  "choices": choices, "git_commit": code_commit()}
        tags = run_tags(choices, str(cfg.stage), str(cfg.preset))
        self.run = wandb.init(
            project=cfg.runtime.tracking.project,
            entity=cfg.runtime.tracking.entity,
            dir=str(wandb_dir),
            mode=cfg.runtime.tracking.mode,
            id=identity.run_id,
            name=identity.name,
            group=identity.group,
            tags=tags,
            config=config,
            resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False,
                                    x_transaction_log_flush_interval=WANDB_FLUSH_S),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log a row of metrics at optimizer step `step`; an epoch's row (it has `val/top1`) also goes to the CSV."""
        if self.run is not None:
            self.run.log(metrics, step=step)
        if self.csv_path is not None and "val/top1" in metrics and "epoch" in metrics:
            write_epoch_row(self.csv_path, {"epoch": metrics["epoch"], "step": step, **metrics})

    def summary(self, values: dict[str, Any]) -> None:
        """Set the run's summary values (the aggregator reads these)."""
        if self.run is not None:
            self.run.summary.update(values)

    def replay(self, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
        """Log a finished run's epoch rows and summary again (its wandb log was removed), then close it."""
        if self.run is not None:
            for row in rows:
                self.run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        self.summary(summary)
        self.finish()

    def finish(self, exit_code: int = 0) -> None:
        """Close the run and flush its files."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
