"""`python -m deit_ablate.sharpness <run folder>`: measure a finished run's sharpness (measure.py says on what),
print it, and record it with the run: result.json's `sharpness` and, where the run has a wandb log, its summary.

The run's model is rebuilt from its folder: its saved config (`.hydra/config.yaml`, over the schema's defaults for
keys added since) and the weights of its final checkpoint (`checkpoint-last.pt`). The wandb summary is updated by
logging the run again offline under its own id: its config, tags and group as its newest log holds them, its epochs
from metrics.csv and that log's summary with the figures added; the aggregator keeps the newest finished log.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from deit_ablate.config.schema import DataConfig
from deit_ablate.core.distributed import choose_device
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.rundir import RunDir, find_run, runs_root, wandb_root
from deit_ablate.run.commands import command, number_option
from deit_ablate.run.measure_sharpness import measure_weights
from deit_ablate.train.sharpness import SharpnessSettings, figures_text, summary_values


def load_run_config(run: RunDir) -> DictConfig:
    """The run's saved config over the schema's defaults (keys added after the run keep their defaults), as its stage
    ran it (stage_config.py: a fine-tune's own model, data and loss)."""
    from deit_ablate.config.schema import Config
    from deit_ablate.config.stage_config import stage_config

    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, False)  # keys the schema has dropped since (the legacy `ablation`) are kept
    return stage_config(OmegaConf.merge(schema, OmegaConf.load(run.hydra_config)))


def finished_run(reference: str) -> RunDir:
    """The finished run folder `reference` names (a folder, or a run name under outputs/runs); a ConfigError
    saying what is wrong and what to do otherwise."""
    from deit_ablate.run.teacher import teacher_run_state

    run = find_run(Path(reference), runs_root("outputs"))
    if run is None or not run.hydra_config.is_file():
        raise ConfigError(f"{reference} is not a run folder (no {'.hydra/config.yaml'} in it): give the folder of a "
                          "run, e.g. outputs/runs/<run name>.")
    state = teacher_run_state(run)
    if state.startswith("unfinished"):
        raise ConfigError(f"the run {run.path} has not finished ({state}, no result.json): launch its command again "
                          "to finish it, then measure it.")
    if state != "finished":
        raise ConfigError(f"the run {run.path} ended as {state}: its final weights are not a trained model to measure.")
    if not run.last_checkpoint.is_file():
        raise ConfigError(f"the run {run.path} has no {run.last_checkpoint.name} (its final weights): nothing to "
                          "measure. Train it again to measure it (delete its folder and launch its command).")
    return run


def check_same_data(data: DataConfig, run: RunDir) -> None:
    """The data block of the run's config (`data`) is the data it trained on (its identity.json's fingerprint)."""
    from deit_ablate.data.datasets import data_fingerprint, describe_data

    recorded = run.recorded_data()
    if recorded is None:
        return
    current = data_fingerprint(data)
    if recorded.get("digest") != current.get("digest"):
        raise ConfigError(f"{run.path} trained on {describe_data(recorded)}, but data.root={data.root} now "
                          f"holds {describe_data(current)}: point --data-root at the data it trained on.")


def measure_run(run: RunDir, settings: SharpnessSettings, device: torch.device, data_root: str | None = None,
                show_progress: bool = True) -> dict[str, Any]:
    """The figures of a finished run at its final weights, with their settings (and the checkpoint measured)."""
    from deit_ablate.record.checkpoint import read_weights

    cfg = load_run_config(run)
    if data_root is not None:
        cfg.data.root = data_root
    check_same_data(cfg.data, run)
    weights = read_weights(run.last_checkpoint)
    record = measure_weights(cfg, weights, device, settings, show_progress)
    record["settings"]["checkpoint"] = run.last_checkpoint.name
    return record


def record_in_result(run: RunDir, record: Mapping[str, Any]) -> None:
    """Put the figures into the run's result.json under `sharpness` (written atomically; other keys kept)."""
    result = run.read_result()
    run.write_result({**result, "sharpness": dict(record)})


def update_wandb(run: RunDir, values: Mapping[str, float]) -> str:
    """Log the run again offline under its id with `values` added to its summary; what was done, in words."""
    from deit_ablate.analysis.aggregate.reader import read_run_file
    from deit_ablate.record.tracking import quiet_wandb, read_epoch_rows, skip_unstaged_launch_inputs, wandb_logs

    output_root = run.path.parent.parent
    run_id = run.read_result()["run_id"]
    files = [file for folder in wandb_logs(output_root, run_id) for file in sorted(folder.glob("*.wandb"))]
    logged = [info for info in (read_run_file(file)[0] for file in files) if info is not None]
    if not logged:
        return f"no wandb log of run id {run_id} under {wandb_root(output_root)}: recorded in result.json only"
    newest = max(logged, key=lambda info: (info.status == "finished", info.start_time is not None,
                                           info.start_time.timestamp() if info.start_time else 0.0))
    quiet_wandb()
    import wandb

    skip_unstaged_launch_inputs(wandb)
    live = wandb.init(project=newest.project or None, dir=str(output_root.resolve()), mode="offline", id=run_id,
                      name=newest.name, group=newest.group or None, tags=list(newest.tags), config=newest.config,
                      resume="allow", settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True,
                                                              save_code=False))
    for row in read_epoch_rows(run.metrics):
        live.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
    live.summary.update({**{k: v for k, v in newest.summary.items() if not k.startswith("_")}, **values})
    live.finish()
    return f"wandb summary of run id {run_id} updated (logged again offline under {wandb_root(output_root)})"


def build_parser() -> argparse.ArgumentParser:
    """The command's options (defaults: the `sharpness` config node's)."""
    d = SharpnessSettings()
    parser = argparse.ArgumentParser(prog="python -m deit_ablate.sharpness", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished run's folder (outputs/runs/<name>) or its name under outputs/runs")
    count, positive = number_option(int, 1), number_option(float, 0, above=True)  # NaN and inf refused too
    parser.add_argument("--images", type=count, default=d.images, help="training images measured on")
    parser.add_argument("--batch-size", type=count, default=d.batch_size, help="images per pass (memory only)")
    parser.add_argument("--iters", type=count, default=d.iters, help="most power iterations for lambda_max")
    parser.add_argument("--tol", type=positive, default=d.tol, help="relative change of lambda_max that stops it")
    parser.add_argument("--sigma", type=number_option(float, 0), default=d.sigma,
                        help="std of the Gaussian weight noise")
    parser.add_argument("--draws", type=count, default=d.draws, help="noise draws the noisy loss averages")
    parser.add_argument("--seed", type=number_option(int, 0), default=d.seed,
                        help="picks the images, start vector and noise")
    parser.add_argument("--device", default="auto", help="auto (the GPU where there is one), cpu, cuda, cuda:1, ...")
    parser.add_argument("--data-root", default=None, help="where the run's data lies now (default: its config's)")
    parser.add_argument("--no-wandb", action="store_true", help="record in result.json only")
    return parser


def settings_of(args: argparse.Namespace) -> SharpnessSettings:
    """The settings the options give; a ConfigError naming a value out of range."""
    settings = SharpnessSettings(images=args.images, batch_size=args.batch_size, iters=args.iters, tol=args.tol,
                                 sigma=args.sigma, draws=args.draws, seed=args.seed)
    at_least_one = [name for name in ("images", "batch_size", "iters", "draws") if getattr(settings, name) < 1]
    if at_least_one or settings.tol <= 0 or settings.sigma < 0:
        bad = at_least_one + (["tol"] if settings.tol <= 0 else []) + (["sigma"] if settings.sigma < 0 else [])
        raise ConfigError(f"--{bad[0].replace('_', '-')}={getattr(settings, bad[0])} is out of range: images, "
                          "batch-size, iters and draws must be >= 1, tol > 0, sigma >= 0.")
    return settings


@command("python -m deit_ablate.sharpness")
def main(argv: list[str] | None = None) -> int:
    """Measure, print, record; 0 on success, 2 with one line on stderr for bad input."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_of(args)
        run = finished_run(args.run)
        device = choose_device(args.device, local_rank=0)
        record = measure_run(run, settings, device, args.data_root, sys.stderr.isatty())
        record_in_result(run, record)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    where = "" if args.no_wandb else "; " + update_wandb(run, summary_values(record))
    print(f"{run.name}\n{figures_text(record)}\nrecorded in {run.result}{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
