"""DeiT Table 7's transfer stage: the finished run a transfer starts from (its source), found by its overrides as a
fine-tune finds its pre-training, and the checks a transfer config gets before anything is queued.

A transfer launched with `transfer=<row>` (or `stage=transfer`) fine-tunes the run of the same command without the
row, the stage, the resolution, the `transfer.*` and the data overrides, at `transfer.source_stage` (the ↑384
fine-tune by default, Table 7's DeiT-B⚗↑384). That run's folder comes from its identity, composed as Hydra would; the
source's data fingerprint and teacher weights digest, as its identity.json records them, enter the transfer's wandb
id and group (with_transfer_source), and a transfer whose source was trained again since is refused.
"""

from __future__ import annotations

from typing import Any

from deit_ablate.config.schema import DataConfig, DataName, DistillConfig, DistillKind, Stage, TransferConfig
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.builtin import CLASS_SETS
from deit_ablate.record.identity import RunIdentity, with_source
from deit_ablate.record.overrides import transfer_source_overrides
from deit_ablate.record.resolvers import run_dir_of
from deit_ablate.record.rundir import DATA, RunDir
from deit_ablate.run.lineage import Lineage

SOURCE_ROLE = "its source run"


def source_overrides(lineage: Lineage) -> list[str] | None:
    """The overrides of the run a transfer starts from (None: not a transfer, or one from transfer.init_checkpoint)."""
    if lineage.stage != Stage.transfer or lineage.transfer_init:
        return None
    return transfer_source_overrides(list(lineage.overrides), lineage.transfer_source_stage)


def source_run_dir(lineage: Lineage) -> RunDir | None:
    """The folder of the run a transfer fine-tunes on its new data (None when there is none to find)."""
    upstream_overrides = source_overrides(lineage)
    if upstream_overrides is None:
        return None
    return run_dir_of(upstream_overrides, lineage.output_root)


def source_identity(source: RunDir | None) -> dict[str, Any] | None:
    """What a transfer's identity takes from its source run: the source's folder, the fingerprint of its data and
    the digest of its teacher's weights (None: it did not distil), as its identity.json records them; None when
    there is no source run (transfer.init_checkpoint) or it has not started."""
    recorded = source.read_identity() if source is not None else None
    if recorded is None:
        return None
    return {"run": source.name, "data": (recorded.get(DATA) or {}).get("digest"),
            "teacher": (recorded.get("teacher") or {}).get("digest")}


def _describe_source(source: dict[str, Any]) -> str:
    return f"data {str(source.get('data'))[:12]}, teacher weights {str(source.get('teacher') or 'none')[:12]}"


def with_transfer_source(identity: RunIdentity, source: RunDir | None, run_dir: RunDir) -> RunIdentity:
    """A transfer's `identity` with its source run's data and teacher (identity.with_source); a ConfigError when the
    transfer's folder records another source (the source was trained again since)."""
    current = source_identity(source)
    recorded = run_dir.read_identity()
    before = (recorded or {}).get("source")
    if current is not None and before is not None and (before.get("data"), before.get("teacher")) != (
            current["data"], current["teacher"]):
        raise ConfigError(
            f"{run_dir.path} holds a transfer of another source run ({_describe_source(before)}) than {source.path} "
            f"is now ({_describe_source(current)}): the source was trained again since. A transfer's source is part "
            "of its identity: transfer the new source under another output folder (runtime.output_root=...), or "
            f"delete {run_dir.path} to transfer it again here.")
    return with_source(identity, current, recorded)


def check_transfer_config(stage: Stage, transfer: TransferConfig, data: DataConfig, distill: DistillConfig,
                          row: str | None = None) -> None:
    """The transfer block and the built-in class set make sense, before anything is queued (`row`: the transfer
    study's row the launch chose, if any)."""
    classes = data.builtin.classes
    if data.name == DataName.builtin and classes not in CLASS_SETS:
        raise ConfigError(f"data.builtin.classes={classes} is not a built-in class set; use one of "
                          f"{', '.join(CLASS_SETS)} (data/builtin.py).")
    if row is not None and stage != Stage.transfer:
        raise ConfigError(f"transfer={row} is a transfer to another dataset (stage=transfer), but stage={stage} "
                          f"was given too: drop stage={stage} to transfer, or drop transfer={row} to train "
                          "that stage on the source's own data.")
    if stage != Stage.transfer:
        return
    if transfer.source_stage == Stage.transfer:
        raise ConfigError("transfer.source_stage=transfer: a transfer starts from a pre-training or a fine-tune; set "
                          "transfer.source_stage=finetune (Table 7's ↑384 model) or pretrain.")
    if distill.teacher_view != "same" and distill.type != DistillKind.none:
        raise ConfigError("distill.teacher_view names what a teacher sees, but the transfer stage trains without its "
                          "source's teacher (other classes): drop distill.teacher_view.")
