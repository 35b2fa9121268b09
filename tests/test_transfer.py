"""DeiT Table 7's transfer stage: the CIFAR-10 reader, the second built-in class set, the source run a transfer
starts from, its recipe and new head, the Table 7 study rows, and (slow) a demo transfer end to end."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    CIFAR_CLASSES,
    TINY,
    compose_config,
    identity_of,
    run_train,
    tiny_with,
    write_cifar10,
    write_cifar100,
)
from omegaconf import OmegaConf
from PIL import Image, ImageDraw

from deit_ablate.analysis.aggregate.paper import paper_table
from deit_ablate.analysis.aggregate.settings import experiment_settings
from deit_ablate.config.compose import compose_run_config
from deit_ablate.config.schema import Stage
from deit_ablate.config.stage_config import stage_config
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.builtin import CLASSES, CLASSES_B, _draw_shape, ensure_builtin_dataset
from deit_ablate.data.cifar10 import (
    CIFAR100_FILES,
    CIFAR100_FOLDER,
    FOLDER,
    META_FILE,
    TRAIN_FILES,
    CIFAR10Pickles,
)
from deit_ablate.data.datasets import build_dataset, check_data_root, data_fingerprint
from deit_ablate.record.identity import composed_choices, experiment, experiment_digest
from deit_ablate.record.overrides import transfer_source_overrides
from deit_ablate.record.rundir import RunDir
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.stages import load_backbone, stage_recipe, upstream_overrides, upstream_role
from deit_ablate.run.student import student_model_name
from deit_ablate.run.transfer import check_transfer_config
from deit_ablate.train.models import build_model

TABLE7 = {"cifar10": ("cifar10", 10, 99.2), "cifar100": ("cifar100", 100, 91.4),
          "flowers": ("imagefolder", 102, 98.9), "cars": ("imagefolder", 196, 93.9),
          "inat18": ("imagefolder", 8142, 80.1), "inat19": ("imagefolder", 1010, 83.0)}
TEACHER = "/nowhere/regnety_160.pth"  # names the source's teacher; a transfer never reads it


def _check_transfer(cfg):
    row = OmegaConf.select(cfg, "hydra.runtime.choices.transfer", default=None)
    check_transfer_config(cfg.stage, cfg.transfer, cfg.data, cfg.distill, row)


def test_cifar100_is_fingerprinted_by_its_files_and_a_missing_one_is_named(tmp_path: Path) -> None:
    for name, per_class in (("a", 1), ("copy_of_a", 1), ("b", 2)):
        write_cifar100(tmp_path / name, per_class)
    prints = {name: data_fingerprint(compose_config(["data=cifar100", f"data.root={tmp_path / name}"]).data)
              for name in ("a", "copy_of_a", "b")}
    assert prints["a"]["classes"] == 100 and prints["a"]["images"] == {"train": 100, "val": 100}
    assert prints["a"]["digest"] == prints["copy_of_a"]["digest"]  # the files, not where they lie
    assert prints["b"]["digest"] != prints["a"]["digest"] and prints["b"]["images"]["train"] == 200
    (tmp_path / "a" / CIFAR100_FOLDER / "test").unlink()
    with pytest.raises(ConfigError, match=r"data=cifar100 found no test under .*cifar-100-python"):
        check_data_root(compose_config(["data=cifar100", f"data.root={tmp_path / 'a'}"]).data)


def test_cifar10_reader_reads_the_pickle_files_it_is_given(tmp_path: Path) -> None:
    written = write_cifar10(tmp_path)
    train, test = CIFAR10Pickles(tmp_path, train=True), CIFAR10Pickles(tmp_path, train=False)
    assert len(train) == 5 * 20 and len(test) == 20 and train.classes == test.classes == CIFAR_CLASSES
    assert train.targets == [label for name in TRAIN_FILES for label in written[name][1]]
    image, label = train[47]  # batch file 2, row 7 (class 3): red = batch, green = class, blue = row
    assert isinstance(image, Image.Image) and image.size == (32, 32) and label == 3
    assert np.asarray(image)[5, 9].tolist() == [2, 3, 7]
    cfg = compose_config(["data=cifar10", f"data.root={tmp_path}"])
    val = build_dataset(cfg.data, "val", lambda x: x, on_bad_image=cfg.runtime.on_bad_image)
    assert check_data_root(cfg.data) == tmp_path and len(val) == 20
    fingerprint = data_fingerprint(cfg.data)
    assert fingerprint["classes"] == 10 and fingerprint["images"] == {"train": 100, "val": 20}
    (tmp_path / FOLDER / TRAIN_FILES[0]).write_bytes((tmp_path / FOLDER / TRAIN_FILES[0]).read_bytes() + b"\0")
    assert data_fingerprint(cfg.data)["digest"] != fingerprint["digest"]  # another file size: other data


def test_cifar10_reader_names_a_missing_file_and_the_layout(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    (tmp_path / FOLDER / "test_batch").unlink()
    with pytest.raises(ConfigError, match=r"found no test_batch under .*cifar-10-batches-py.*data.root"):
        CIFAR10Pickles(tmp_path, train=True)
    with pytest.raises(ConfigError, match="test_batch"):
        check_data_root(compose_config(["data=cifar10", f"data.root={tmp_path}"]).data)


class _WritesAMarker:
    """What a crafted pickle holds: unpickling it runs exec, which writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


CRAFTED = [("cifar10", f"{FOLDER}/{META_FILE}"), ("cifar100", f"{CIFAR100_FOLDER}/{CIFAR100_FILES['meta']}")]


def _crafted(tmp_path: Path, data: str, crafted: str) -> tuple[list[str], str, Path]:
    """A CIFAR folder whose file `crafted` runs exec when unpickled (it would write `marker`); the data overrides
    and the error expected."""
    root, marker = tmp_path / "data", tmp_path / "marker"
    (write_cifar10 if data == "cifar10" else write_cifar100)(root)
    with open(root / crafted, "wb") as handle:
        pickle.dump({b"label_names": [b"a"], b"fine_label_names": [b"a"], b"payload": _WritesAMarker(marker)},
                    handle)
    refused = rf"{re.escape(str(root / crafted))} is not a CIFAR file: it names the Python global builtins\.exec"
    overrides = [f"data={data}", f"data.root={root}", f"data.num_classes={10 if data == 'cifar10' else 100}"]
    return overrides, refused, marker


@pytest.mark.parametrize(("data", "crafted"), CRAFTED)
def test_a_crafted_cifar_file_is_never_unpickled_and_is_named(tmp_path: Path, data: str, crafted: str) -> None:
    overrides, refused, marker = _crafted(tmp_path, data, crafted)
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=refused):
        data_fingerprint(cfg.data)
    with pytest.raises(ConfigError, match=refused):
        build_dataset(cfg.data, "train", lambda x: x, on_bad_image=cfg.runtime.on_bad_image)
    assert not marker.exists()  # nothing it names ran


@pytest.mark.slow
@pytest.mark.parametrize(("data", "crafted"), CRAFTED)
def test_a_crafted_cifar_file_stops_a_dry_run_and_a_run_with_one_line(tmp_path: Path, data_cache: Path, data: str,
                                                                      crafted: str) -> None:
    overrides, refused, marker = _crafted(tmp_path, data, crafted)
    for extra in (["runtime.dry_run=true"], []):  # the dry run, and training
        proc = run_train([*overrides, *TINY, *extra], tmp_path, data_cache, check=False)
        assert proc.returncode == 2 and re.search(refused, proc.stdout + proc.stderr), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert not marker.exists()


def _mask(name: str) -> np.ndarray:
    """The shape `name` drawn alone, upright and centred: its pixels."""
    image = Image.new("L", (64, 64), 0)
    _draw_shape(ImageDraw.Draw(image), name, 32, 32, 24, 0.0, 255, 0)
    return np.asarray(image) > 0


def test_second_builtin_class_set_draws_other_distinct_shapes(tmp_path: Path) -> None:
    assert len(CLASSES_B) == 10 and not set(CLASSES_B) & set(CLASSES)
    masks = {name: _mask(name) for name in CLASSES_B}
    assert all(mask.mean() > 0.05 for mask in masks.values())
    for a in CLASSES_B:  # no two shapes cover nearly the same pixels
        for b in CLASSES_B:
            if a < b:
                overlap = (masks[a] & masks[b]).sum() / (masks[a] | masks[b]).sum()
                assert overlap < 0.85, (a, b, overlap)
    default = ensure_builtin_dataset(tmp_path, 16, 2, 1)
    second = ensure_builtin_dataset(tmp_path, 16, 2, 1, class_set="shapes_b")
    assert default.name == "s16-n2-1-seed0" and second != default  # the default keeps its cache folder
    assert sorted(p.name for p in (second / "train").iterdir()) == sorted(CLASSES_B)
    with pytest.raises(ConfigError, match="data.builtin.classes=circles"):
        _check_transfer(compose_config(["data.builtin.classes=circles"]))


def test_default_builtin_digest_is_unchanged_and_the_second_set_is_other_data() -> None:
    cfg = compose_config([])
    before = {"image_size": 40, "train_per_class": 500, "val_per_class": 100, "seed": 0}  # main's formula
    digest = hashlib.sha1(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert data_fingerprint(cfg.data) == {"digest": digest, "builtin": before}
    assert data_fingerprint(compose_config(["transfer=builtin_b"]).data)["digest"] != digest
    assert "classes" not in experiment(cfg)["data"]["builtin"]  # runs before the key keep their digest


def test_source_overrides_drop_the_transfer_and_its_dataset() -> None:
    overrides = ["preset=paper", "transfer=cifar10", "stage=transfer", "resolution=384px", "transfer.lr=0.02",
                 "transfer_recipe=cait", "data.root=/data/cifar10", "data.num_classes=10", "distill=hard_token",
                 f"distill.teacher.checkpoint={TEACHER}", "data.builtin.train_per_class=30", "seed=1"]
    kept = ["preset=paper", "distill=hard_token", f"distill.teacher.checkpoint={TEACHER}",
            "data.builtin.train_per_class=30", "seed=1"]
    assert transfer_source_overrides(overrides, "finetune") == ["stage=finetune", *kept]
    assert transfer_source_overrides(overrides, "pretrain") == kept
    cfg = compose_config(["transfer=builtin_b", "transfer.source_stage=pretrain"])
    lineage = Lineage.of(cfg, ["transfer=builtin_b", "transfer.source_stage=pretrain", "seed=2"])
    assert upstream_overrides(lineage) == ["seed=2"]
    assert upstream_role(Lineage.of(cfg, ())) == "its source run"
    with pytest.raises(ConfigError, match="transfer.source_stage=transfer"):
        _check_transfer(compose_config(["transfer=builtin_b", "transfer.source_stage=transfer"]))
    with pytest.raises(ConfigError, match="transfer=builtin_b is a transfer .* drop stage=finetune"):
        _check_transfer(compose_run_config(["transfer=builtin_b", "stage=finetune"]))


def test_paper_transfer_recipe_is_issue_45s(tmp_path: Path) -> None:
    cfg = compose_config(["preset=paper", "transfer=cifar10"])
    recipe = stage_recipe(cfg, RunDir(tmp_path / "source"))
    assert (recipe.optimizer, recipe.lr, recipe.weight_decay, recipe.global_batch) == ("sgd", 0.01, 1e-4, 768)
    assert recipe.lr_base_batch == 768  # 0.01 at its batch, as the author reads his numbers (issue #141)
    assert (recipe.epochs, recipe.warmup_epochs, recipe.min_lr, recipe.train_mode) == (1000, 5.0, 1e-5, True)
    assert recipe.init_checkpoint == RunDir(tmp_path / "source").last_checkpoint
    applied = stage_config(cfg)  # what the run's pieces are taken from (plan.settings)
    assert applied.augment.reprob == 0.0 and applied.model.drop_path == 0.0
    assert cfg.augment.reprob == 0.25 and cfg.model.drop_path == 0.1  # the source's own, left as they were
    assert cfg.resolution.train_size == 384 and cfg.augment.auto_augment == "rand-m9-mstd0.5-inc1"
    assert (cfg.mix.mixup_alpha, cfg.mix.cutmix_alpha, cfg.augment.repeated_aug) == (0.8, 1.0, 3)


def test_pretrain_and_finetune_identities_ignore_the_transfer_block() -> None:
    for stage, drop in ((["stage=pretrain"], ("finetune",)), (["stage=finetune"], ())):
        base = identity_of([*stage, "ablation=no_mixup"])
        assert identity_of([*stage, "ablation=no_mixup", "transfer.lr=0.5"]).digest == base.digest
        # main's formula, on the config without the transfer node it did not have
        cfg = compose_run_config([*stage, "ablation=no_mixup"])
        before = OmegaConf.create({str(k): OmegaConf.to_container(cfg[k], resolve=True, enum_to_str=True)
                                   if OmegaConf.is_config(cfg[k]) else cfg[k]
                                   for k in cfg if k not in ("hydra", "transfer")})
        assert experiment_digest(before, drop, composed_choices(cfg)) == base.digest
    transfer = identity_of(["transfer=builtin_b"])
    assert identity_of(["transfer=builtin_b", "transfer.lr=0.5"]).digest != transfer.digest
    assert identity_of(["transfer=builtin_b", "finetune.lr=1e-3"]).digest != transfer.digest  # names its source
    # the aggregator: a log from before the transfer node is the same setting as one with it
    config = OmegaConf.to_container(compose_config(["stage=finetune"]), resolve=True)
    old = {k: v for k, v in config.items() if k != "transfer"}
    assert experiment_settings(config) == experiment_settings(old)


@pytest.mark.parametrize("row", sorted(TABLE7))
def test_table7_rows_at_paper_scale(row: str) -> None:
    cfg = compose_run_config(["preset=paper", f"transfer={row}", "distill=hard_token",
                              f"distill.teacher.checkpoint={TEACHER}", "runtime.data_dir=/datasets"])
    data, classes, top1 = TABLE7[row]
    assert cfg.stage == Stage.transfer and cfg.hydra.runtime.choices.resolution == "paper_transfer"
    assert student_model_name(cfg.model, cfg.distill) == "deit_base_distilled_patch16_224"
    assert cfg.resolution.train_size == 384
    assert (cfg.data.name, cfg.data.num_classes, cfg.data.root) == (data, classes, f"/datasets/{row}")
    table = paper_table("table7")
    assert table.model == "DeiT-B⚗↑384" and table.row(row).values["transfer"] == top1


@pytest.mark.parametrize("distilled", [False, True])
def test_transfer_gets_new_heads_and_the_source_backbone(tmp_path: Path, distilled: bool) -> None:
    model_cfg = compose_config(["model.kwargs.depth=1", "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2"]).model
    name = "deit_tiny_distilled_patch16_224" if distilled else None
    torch.manual_seed(0)
    source = build_model(model_cfg, 10, 32, name=name)
    torch.save({"model": source.state_dict(), "step": 1}, tmp_path / "checkpoint-last.pt")
    torch.manual_seed(1)
    target = build_model(model_cfg, 7, 48, name=name)
    new_head = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("head")}
    heads = load_backbone(target, tmp_path / "checkpoint-last.pt")
    assert heads == (("head", "head_dist") if distilled else ("head",))
    state, before = target.state_dict(), source.state_dict()
    for key, value in state.items():
        if key.startswith("head"):
            assert value.shape[0] == 7 and torch.equal(value, new_head[key]), key
        elif key == "pos_embed":
            prefix = 2 if distilled else 1
            assert value.shape[1] == prefix + 36 and torch.equal(value[:, :prefix], before[key][:, :prefix])
        else:
            assert torch.equal(value, before[key]), key


@pytest.mark.slow
def test_paper_table7_dry_run_finds_its_source_run(tmp_path: Path, data_cache: Path) -> None:
    data_dir = tmp_path / "datasets"
    write_cifar10(data_dir / "cifar10")
    write_cifar100(data_dir / "cifar100")
    png = tmp_path / "one.png"
    Image.new("RGB", (8, 8)).save(png)
    for row in ("flowers", "cars"):
        for split in ("train", "val"):
            for k in range(TABLE7[row][1]):
                (data_dir / row / split / f"c{k:03d}").mkdir(parents=True)
                (data_dir / row / split / f"c{k:03d}" / "a.png").hardlink_to(png)
    common = ["preset=paper", "distill=hard_token", f"distill.teacher.checkpoint={TEACHER}"]
    proc = run_train(["-m", "transfer=cifar10,cifar100,flowers,cars", *common, f"runtime.data_dir={data_dir}",
                      "runtime.dry_run=true"], tmp_path, data_cache)
    source = identity_of(["stage=finetune", *common]).name
    lines = re.findall(r"\[dry run\] (\S+) \(wandb id ([^)]+)\): (.*)", proc.stdout)
    assert len(lines) == 4 and {plan for _, _, plan in lines} == {f"wait for its source run {source}"}
    assert {wandb for _, wandb, _ in lines} == {"pending: keyed by its source run's data and teacher weights"}
    assert {name.split(",")[-1].split("-")[0] for name, _, _ in lines} == {f"transfer={r}" for r in
                                                                         ("cifar10", "cifar100", "flowers", "cars")}


@pytest.mark.slow
def test_demo_transfer_to_the_second_builtin_set_end_to_end(tmp_path: Path, data_cache: Path, tiny_run) -> None:
    tiny_run.copy_into(tmp_path)
    source = tiny_run.run_dir()
    args = ["transfer=builtin_b", "transfer.source_stage=pretrain", "transfer.global_batch=32", "transfer.epochs=2",
            *TINY]
    assert f"starting from {source.name}" in run_train([*args, "runtime.dry_run=true"], tmp_path, data_cache).stdout
    run_train(args, tmp_path, data_cache)
    (run,) = [p for p in (tmp_path / "outputs" / "runs").iterdir() if p.name.startswith("transfer=builtin_b")]
    result = json.loads(RunDir(run).result.read_text())
    assert result["status"] == "finished" and result["epochs_done"] == 2 and result["top1"] >= 0.0
    assert result["transfer_from"]["run"] == source.name and result["transfer_from"]["heads"] == ["head"]
    assert result["data_fingerprint"]["builtin"]["classes"] == "shapes_b"
    source_data = RunDir(source).read_identity()["data_fingerprint"]["digest"]
    assert RunDir(run).read_identity()["source"] == {"run": source.name, "data": source_data, "teacher": None}
    trained = torch.load(RunDir(run).last_checkpoint, weights_only=True)["model"]
    before = torch.load(RunDir(source).last_checkpoint, weights_only=True)["model"]
    assert trained["head.weight"].shape == (10, 32) and not torch.equal(trained["head.weight"], before["head.weight"])


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch: start the cluster with scripts/slurm_up.sh")
def test_slurm_chains_a_transfer_after_its_source(tmp_path: Path, data_cache: Path) -> None:
    # a sweep can hold a source and its transfer when the transfer keeps the source's data (stage=transfer, no row)
    slurm = ["hydra/launcher=slurm_8gpu", "hydra.launcher.cpus_per_task=2", "hydra.launcher.timeout_min=20"]
    proc = run_train(["-m", "stage=pretrain,transfer", "transfer.source_stage=pretrain", "transfer.global_batch=32",
                      "train.max_steps=3", *slurm, *tiny_with(4)], tmp_path, data_cache, timeout=900)
    assert re.search(r"#1 : stage=transfer .* waits for job \d+ \(its source run\)", proc.stderr + proc.stdout, re.S)
    results = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "outputs" / "runs").glob("*/result.json")}
    (transfer,) = [r for r in results.values() if "transfer_from" in r]
    assert transfer["status"] == "finished" and transfer["transfer_from"]["run"] in results
    assert results[transfer["transfer_from"]["run"]]["status"] == "finished"


SOURCE_OF_A_DISTILLED_RUN = ["transfer=builtin_b", "transfer.source_stage=pretrain", "distill=hard_token",
                             f"distill.teacher.checkpoint={TEACHER}"]


def _transfer_plan(root: Path, *extra: str):
    """The plan of a demo transfer of a distilled run under the output root `root`, and its source's folder."""
    from deit_ablate.core.distributed import DistInfo
    from deit_ablate.run.plan import make_plan

    overrides = [*SOURCE_OF_A_DISTILLED_RUN, f"runtime.output_root={root}", *extra]
    cfg = compose_run_config(overrides)
    plan = make_plan(cfg, DistInfo(), RunDir.under(root, identity_of(overrides).name), overrides)
    return plan, plan.upstream


def _record_source(source: RunDir, teacher_digest: str | None, data_digest: str = "d" * 16) -> None:
    """The identity.json a distilled source run (teacher weights `teacher_digest`) wrote at its first start."""
    source.path.mkdir(parents=True, exist_ok=True)
    teacher = {"teacher": {"run": None, "checkpoint": TEACHER, "digest": teacher_digest}} if teacher_digest else {}
    source.write_identity({"name": source.name, "run_id": "0" * 16, "experiment_digest": source.name[-10:],
                           "data_fingerprint": {"digest": data_digest}, **teacher})


def test_a_transfer_carries_its_sources_teacher_weights_and_data(tmp_path: Path) -> None:
    sources = (("a", "a" * 40, "d" * 16), ("b", "b" * 40, "d" * 16), ("c", "a" * 40, "e" * 16))
    identities = []
    for root, teacher, data in sources:
        _, source = _transfer_plan(tmp_path / root)
        _record_source(source, teacher, data)
        identities.append(_transfer_plan(tmp_path / root)[0].identity)
    a, b, c = identities
    assert a.name == b.name == c.name and a.digest == b.digest  # one folder name: the same settings...
    assert len({a.run_id, b.run_id, c.run_id}) == 3 and len({a.group, b.group, c.group}) == 3  # ...three wandb runs
    for identity, (_, teacher, data) in zip(identities, sources, strict=True):  # identity.json records it
        assert identity.source == {"run": source.name, "data": data, "teacher": teacher}


def test_a_transfer_dry_run_before_its_source_says_its_wandb_id_is_pending(tmp_path: Path) -> None:
    from deit_ablate.run.lifecycle import dry_run_line

    plan, source = _transfer_plan(tmp_path, "runtime.dry_run=true")
    line = dry_run_line(plan)
    assert "(wandb id pending: keyed by its source run's data and teacher weights)" in line, line
    assert line.endswith(f"wait for its source run {source.name}")
    _record_source(source, "a" * 40)
    dry, real = _transfer_plan(tmp_path, "runtime.dry_run=true")[0], _transfer_plan(tmp_path)[0]
    assert f"(wandb id {real.identity.run_id})" in dry_run_line(dry)


def test_a_transfer_of_a_source_trained_again_is_refused_and_an_old_folder_keeps_its_wandb_id(tmp_path):
    plan, source = _transfer_plan(tmp_path)
    before = plan.identity.run_id  # the wandb id transfers had before they carried their source
    _record_source(source, "a" * 40)
    plan, _ = _transfer_plan(tmp_path)
    plan.run_dir.path.mkdir(parents=True)
    plan.run_dir.record_identity(plan.identity, plan.data)
    _record_source(source, "b" * 40)  # the source was deleted and trained again, from other teacher weights
    with pytest.raises(ConfigError, match="another source run.*runtime.output_root"):
        _transfer_plan(tmp_path)
    old = {k: v for k, v in plan.run_dir.read_identity().items() if k != "source"}  # written before sources were
    plan.run_dir.write_identity({**old, "run_id": before})
    assert _transfer_plan(tmp_path)[0].identity.run_id == before != plan.identity.run_id
