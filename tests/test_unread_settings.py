"""Settings the recipe never reads (keys.UNREAD) change no identity: colour jitter beside RandAugment, the Mixup/CutMix
switch without both, a distillation's weight without a teacher. A run that sets one is the run that computes the
same (folder, wandb id, group); where the setting is read it is another run; a sweep's dry run and the study check
name the setting and why it is ignored."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from deit_ablate.config.studies import paper_tables, studies
from deit_ablate.record.identity import experiment_digest
from tests.conftest import CONF, identity_of, run_train

FINETUNE_WITHOUT_POLICY = "++finetune.overrides={augment:{auto_augment:null}}"
FINETUNE_OWN_JITTER = "++finetune.overrides={augment:{auto_augment:null,color_jitter:0.1}}"  # the stage's own value
# setting -> (runs where it is never read: the same run without it; runs where it is read: another run)
CASES = {
    "augment.color_jitter=0.2": (
        [["ablation=baseline"], ["augment=autoaugment"], ["stage=finetune"], ["preset=paper"],
         ["stage=finetune", FINETUNE_OWN_JITTER]],
        [["augment=none"], ["augment=three_augment"], ["stage=finetune", FINETUNE_WITHOUT_POLICY]]),
    "mix.switch_prob=0.2": (
        [["mix=mixup_only"], ["mix=cutmix_only"], ["mix=none"], ["ablation=no_mixup", "preset=paper"]],
        [[], ["mix.prob=0.5"]]),
    "distill.alpha=0.3": (
        [[], ["distill=none", "stage=finetune"], ["preset=paper"]],
        [["distill=soft"], ["distill=hard"], ["distill=hard_token"]]),
    "distill.tau=2.0": ([["distill=hard"], ["distill=hard_token"], []], [["distill=soft"], ["distill=soft_token"]]),
    "augment.remode=const": ([["ablation=no_erasing"]], [[]]),
    "mix.mode=pair": ([["mix=none"]], [[]]),
    "optimizer.momentum=0.5": ([[], ["optimizer=lamb"]],
                               [["optimizer=sgd"], ["stage=finetune", "finetune.optimizer=sgd"]]),
    "optimizer.eps=1e-6": ([["optimizer=sgd"]], [[]]),
}


def _triple(overrides: list[str]) -> tuple[str, str, str]:
    identity = identity_of(overrides)
    return identity.name, identity.run_id, identity.group


@pytest.mark.parametrize("setting", sorted(CASES))
def test_a_setting_no_stage_reads_leaves_the_identity_and_one_that_is_read_does_not(setting):
    unread, read = CASES[setting]
    for base in unread:
        assert _triple([*base, setting]) == _triple(base), f"{setting} under {base}"
    for base in read:
        assert _triple([*base, setting])[1] != _triple(base)[1], f"{setting} under {base} is read"


def test_the_identity_leaves_out_a_value_the_config_still_holds():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        ours, baseline = (compose("config", overrides=["preset=paper", *extra], return_hydra_config=True)
                          for extra in (["augment.color_jitter=0"], []))
    assert experiment_digest(ours) == experiment_digest(baseline)
    assert ours.augment.color_jitter == 0 and ours.augment.auto_augment == "rand-m9-mstd0.5-inc1"  # a copy is edited


def computes_the_same(row: list[str], baseline: list[str], conf: Path = CONF) -> str | None:
    """The study check: why `row` (a fine-tune, which covers its pre-training) computes exactly what `baseline`
    does, whatever Hydra choices name them; None when it computes something else."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        ours, theirs = (compose("config", overrides=[*o, "stage=finetune"]) for o in (row, baseline))
    if experiment_digest(ours, ("transfer",)) != experiment_digest(theirs, ("transfer",)):
        return None
    from deit_ablate.record.identity import experiment, same_computation

    declared = (experiment(cfg, ("transfer",), canonical=False) for cfg in (ours, theirs))
    return same_computation(*declared) or "it changes no setting"


def test_the_study_check_fails_a_row_that_changes_only_a_setting_no_stage_reads(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "ablation" / "no_color_jitter.yaml").write_text("# @package _global_\naugment:\n  color_jitter: 0.0\n")
    why = computes_the_same(["ablation=no_color_jitter"], ["ablation=baseline"], conf)
    assert why is not None and why.startswith("augment.color_jitter is ignored because timm applies colour jitter "
                                              "only when no RandAugment/AutoAugment policy is on"), why
    assert computes_the_same(["ablation=no_erasing"], ["ablation=baseline"], conf) is None


def _study_rows() -> list[tuple[str, str, str]]:
    """(study, row, the row its Δ is measured against) of every study row with a baseline of its own."""
    found = []
    for study in studies():
        table = paper_tables()[study.table]
        own = {row["key"]: row.get("baseline") for row in table["rows"]}
        pairs = ((row, own.get(row) or table.get("baseline")) for row in study.rows)
        found += [(study.name, row, baseline) for row, baseline in pairs if baseline not in (None, row)]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["demo", "paper"])
def test_every_study_row_computes_something_else_than_its_baseline(preset):
    same = {f"{study}={row}": computes_the_same([f"preset={preset}", f"{study}={row}"],
                                                [f"preset={preset}", f"{study}={baseline}"])
            for study, row, baseline in _study_rows()}
    assert {row: why for row, why in same.items() if why is not None} == {}


@pytest.mark.slow
def test_the_dry_run_says_which_run_of_a_sweep_computes_the_same_and_why(tmp_path, data_cache):
    proc = run_train(["-m", "ablation=baseline,no_erasing", "augment.color_jitter=0,0.2", "runtime.dry_run=true"],
                     tmp_path, data_cache)
    lines = [line for line in proc.stdout.splitlines() if "computes the same" in line]
    because = ("(augment.color_jitter is ignored because timm applies colour jitter only when no RandAugment/"
               "AutoAugment policy is on (create_transform; 3-Augment keeps it), and augment.auto_augment sets one)")
    assert lines == [f"[dry run] row augment.color_jitter=0.2 computes the same as row augment.color_jitter=0 {because}"
                     ] * 2, proc.stdout
    assert not (tmp_path / "outputs").exists()
