"""Predictions kept with a finished run, and the disagreement matrix of runs (DeiT Table 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from torch.utils.data import DataLoader, TensorDataset

from deit_ablate.analysis import disagreement
from deit_ablate.analysis.aggregate.disagree import (
    check_comparable,
    disagreement_matrix,
    load_predictions,
    paper_pairs,
)
from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.loader import ShardSampler
from deit_ablate.record.predictions import INDEX, LocalPredictions, compact, gather_in_order, in_dataset_order
from deit_ablate.record.rundir import PREDICTIONS, RunDir
from deit_ablate.train.trainer import evaluate
from tests.conftest import TINY, run_train, transform_spec

BUILTIN = {"image_size": 40, "train_per_class": 30, "val_per_class": 10, "seed": 0}
OTHER = {**BUILTIN, "seed": 1}
#                 images: 0  1  2  3  4  5  6  7  8  9
LABELS = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])
TEACHER = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 3])  # wrong on 9
PLAIN = np.array([0, 1, 0, 3, 4, 1, 1, 2, 2, 4])  # != teacher on 2, 5, 8, 9: 40 %
CLS = np.array([0, 1, 2, 0, 4, 0, 1, 2, 3, 4])  # != teacher on 3, 9: 20 %
DIST = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])  # != teacher on 9: 10 %
FUSED = np.array([0, 1, 2, 3, 4, 0, 2, 2, 3, 4])  # != teacher on 6, 9: 20 %; != plain on 2, 5, 6, 8: 40 %


def fingerprint(params: dict) -> dict:
    return {"digest": "a" * 16 if params == BUILTIN else "b" * 16, "builtin": params}


def make_run(root: Path, name: str, heads: dict[str, np.ndarray], data: dict = BUILTIN,
             teacher: str | None = None, predictions: bool = True) -> RunDir:
    """A finished run folder holding `heads` as its predictions (and result.json naming its teacher run)."""
    run = RunDir(root / name)
    run.path.mkdir(parents=True)
    if predictions:
        arrays = {**heads, "labels": LABELS[:len(next(iter(heads.values())))]}
        arrays[INDEX] = np.arange(len(arrays["labels"]))
        run.write_predictions(compact(arrays), {"name": name, "data_fingerprint": fingerprint(data),
                                                "model_name": name.split("-")[0], "split": "val"})
    result = {"status": "finished", "top1": 50.0, **({"teacher": {"run": str(root / teacher)}} if teacher else {})}
    run.write_result(result)
    return run


def test_disagreement_counts_the_images_two_predictions_differ_on():
    matrix = disagreement_matrix([TEACHER, PLAIN, CLS, DIST, FUSED])
    # by hand from the arrays above
    assert matrix[0].tolist() == pytest.approx([0.0, 40.0, 20.0, 10.0, 20.0])
    assert matrix[1, 4] == pytest.approx(40.0) and matrix[4, 1] == pytest.approx(40.0)
    assert matrix[2, 3] == pytest.approx(10.0)  # the class and the distillation heads differ on image 3


def test_the_command_prints_the_matrix_and_the_paper_values_beside_ours(tmp_path, capsys):
    make_run(tmp_path, "cnn-aaaaaaaaaa", {"main": TEACHER})
    make_run(tmp_path, "deit-bbbbbbbbbb", {"main": PLAIN})
    make_run(tmp_path, "deitd-cccccccccc", {"cls": CLS, "dist": DIST, "fused": FUSED}, teacher="cnn-aaaaaaaaaa")
    out = tmp_path / "out"
    code = disagreement.main([str(tmp_path / n) for n in ("cnn-aaaaaaaaaa", "deit-bbbbbbbbbb", "deitd-cccccccccc")]
                             + ["--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| deitd (dist head) | 10.0 | 30.0 | 10.0 | 0.0 | 10.0 |" in printed  # vs cnn, deit, cls, dist, fused
    saved = json.loads((out / "disagreement.json").read_text())
    assert saved["labels"] == ["cnn", "deit", "deitd (class head)", "deitd (dist head)", "deitd (fused)"]
    assert saved["percent"][0] == pytest.approx([0.0, 40.0, 20.0, 10.0, 20.0])
    ours = {row["paper"]: row["ours"] for row in saved["paper_table4"]}
    assert ours == {10.2: pytest.approx(20.0), 10.7: pytest.approx(40.0), 10.0: pytest.approx(10.0),
                    13.3: pytest.approx(40.0)}
    assert sorted(p["percent"] for p in paper_pairs()["pairs"]) == [10.0, 10.2, 10.7, 13.3]
    assert (out / "disagreement.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "disagreement.csv").read_text().splitlines()[1].startswith("cnn,0.0000,40.0000")


def test_runs_on_other_data_are_refused_naming_both(tmp_path):
    a = load_predictions(make_run(tmp_path, "one-aaaaaaaaaa", {"main": TEACHER}))
    b = load_predictions(make_run(tmp_path, "two-bbbbbbbbbb", {"main": PLAIN}, data=OTHER))
    with pytest.raises(ConfigError) as error:
        check_comparable([a, b])
    message = str(error.value)
    assert "one-aaaaaaaaaa" in message and "two-bbbbbbbbbb" in message
    assert "'seed': 0" in message and "'seed': 1" in message  # both datasets described
    fewer = load_predictions(make_run(tmp_path, "three-cccccccccc", {"main": PLAIN[:7]}))
    with pytest.raises(ConfigError, match="10 images.*three-cccccccccc of 7"):
        check_comparable([a, fewer])


def test_a_run_without_predictions_is_named_with_the_fix(tmp_path, capsys):
    make_run(tmp_path, "old-aaaaaaaaaa", {"main": TEACHER}, predictions=False)
    make_run(tmp_path, "new-bbbbbbbbbb", {"main": PLAIN})
    code = disagreement.main([str(tmp_path / "new-bbbbbbbbbb"), str(tmp_path / "old-aaaaaaaaaa")])
    err = capsys.readouterr().err
    assert code == 2
    assert "old-aaaaaaaaaa" in err and "no predictions.npz" in err and "delete its result.json" in err
    assert err.count("\n") == 1


def test_the_predictions_file_is_written_atomically(tmp_path, monkeypatch):
    run = make_run(tmp_path, "run-aaaaaaaaaa", {"main": TEACHER})
    arrays, record = run.read_predictions()
    assert arrays["main"].tolist() == TEACHER.tolist() and arrays["main"].dtype == np.int16
    assert record["name"] == "run-aaaaaaaaaa"
    assert [p.name for p in run.path.iterdir() if p.name.endswith(".tmp")] == []
    run.predictions.unlink()

    def fail_midway(handle, **arrays):
        handle.write(b"PK\x03\x04 half a zip")
        raise OSError("disk went away")

    monkeypatch.setattr(np, "savez_compressed", fail_midway)
    with pytest.raises(OSError, match="disk went away"):
        run.write_predictions({"main": TEACHER}, {})
    assert not run.predictions.exists()
    assert [p.name for p in run.path.iterdir() if p.name.startswith(f".{PREDICTIONS}")] == []


def test_shards_go_back_in_dataset_order_each_image_once():
    # rank 0 saw 0, 2, 4 and a padding repeat of 0; rank 1 saw 1, 3
    shards = [([0, 2, 4, 0], {"main": np.array([10, 12, 14, 10])}), ([1, 3], {"main": np.array([11, 13])})]
    merged = in_dataset_order(shards)
    assert merged[INDEX].tolist() == [0, 1, 2, 3, 4]
    assert merged["main"].tolist() == [10, 11, 12, 13, 14]


def test_the_final_evaluation_keeps_the_predictions_of_the_headline_weights():
    from types import SimpleNamespace

    from deit_ablate.run.loop import EpochLoop, Progress
    from deit_ablate.train.losses import distilled_head_logits, fuse_predictions

    dataset = eval_data()
    images = dataset.tensors[0]
    loader = DataLoader(dataset, batch_size=3, sampler=ShardSampler(len(dataset), 1, 0))
    model, ema = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 5)), tiny_distilled()
    with torch.inference_mode():
        by_model = model(images).argmax(1).tolist()
        by_ema = fuse_predictions(*distilled_head_logits(ema.eval(), images), "prob").argmax(1).tolist()
    settings = SimpleNamespace(train=SimpleNamespace(eval_max_batches=None), distill=SimpleNamespace(fusion="prob"))
    # without EMA the model's predictions; with EMA (its top-1 is the headline) the EMA's
    for kept, whose, head, expected in ((None, "model", "main", by_model),
                                        (SimpleNamespace(module=ema), "ema", "fused", by_ema)):
        loop = SimpleNamespace(progress=Progress(), plan=SimpleNamespace(settings=settings),
                               pieces=SimpleNamespace(loaders=SimpleNamespace(val_loader=loader)),
                               trainer=SimpleNamespace(model=model, ema=kept, info=DistInfo(), amp_dtype=None),
                               collect_bad_images=lambda: None)
        EpochLoop.evaluate_now(loop)
        arrays = loop.progress.predictions.arrays()
        assert loop.progress.predicted_by == whose
        assert arrays[head].tolist() == expected
        assert arrays["labels"].tolist() == dataset.tensors[1].tolist()


# --- two ranks -------------------------------------------------------------------------------------------------

IMAGES = 7  # not divisible by 2: rank 0 evaluates 4 images, rank 1 three


def tiny_distilled() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_distilled_patch16_224", img_size=16, patch_size=8, embed_dim=32, depth=1,
                             num_heads=2, num_classes=5)


def eval_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(IMAGES, 3, 16, 16, generator=generator), torch.arange(IMAGES) % 5)


def predictions_of(model: torch.nn.Module, info: DistInfo) -> dict[str, np.ndarray] | None:
    """Evaluate `model` on this rank's shard of eval_data, in batches of 2; the gathered predictions (rank 0)."""
    dataset = eval_data()
    loader = DataLoader(dataset, batch_size=2, sampler=ShardSampler(len(dataset), info.world_size, info.rank))
    local = LocalPredictions()
    evaluate(model, loader, info, fusion="prob", predictions=local)
    return gather_in_order(local, loader, info)


def _two_rank_worker(rank: int, store: str, weights: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = tiny_distilled()
        model.load_state_dict(torch.load(weights))
        arrays = predictions_of(model, DistInfo(rank=rank, world_size=2))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        np.savez(out, **arrays)
    else:
        assert arrays is None  # only rank 0 holds (and writes) them


def test_two_ranks_gather_the_predictions_of_one_in_dataset_order(tmp_path):
    import torch.multiprocessing as mp

    model = tiny_distilled()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    alone = predictions_of(model, DistInfo())
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), str(tmp_path / "weights.pt"), str(tmp_path / "two.npz")),
             nprocs=2, join=True)
    with np.load(tmp_path / "two.npz") as two:
        assert sorted(two.files) == sorted(alone) == ["cls", "dist", "fused", "index", "labels"]
        for name in alone:
            assert two[name].tolist() == alone[name].tolist(), name
    assert alone[INDEX].tolist() == list(range(IMAGES))
    assert alone["labels"].tolist() == (torch.arange(IMAGES) % 5).tolist()  # dataset order
    with torch.inference_mode():
        cls_logits = model.head(model.forward_features(eval_data().tensors[0])[:, 0])
    assert alone["cls"].tolist() == cls_logits.argmax(1).tolist()


# --- end to end ------------------------------------------------------------------------------------------------

def redo_predictions(run: RunDir, data_cache: Path, monkeypatch) -> dict[str, np.ndarray]:
    """Evaluate the run's last checkpoint again on its val split, by hand: per head, the argmax."""
    from deit_ablate.analysis.sharpness import load_run_config
    from deit_ablate.data.datasets import build_dataset, dataset_root
    from deit_ablate.data.transforms import build_eval_transform
    from deit_ablate.record.checkpoint import read_weights
    from deit_ablate.run.measure_sharpness import rebuild_model
    from deit_ablate.run.student import student_spec
    from deit_ablate.train.losses import distilled_head_logits, fuse_predictions

    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(data_cache))
    cfg = load_run_config(run)
    model = rebuild_model(student_spec(cfg), read_weights(run.last_checkpoint), torch.device("cpu"))
    model.eval()
    dataset = build_dataset(cfg.data, "val", build_eval_transform(transform_spec(cfg)), dataset_root(cfg.data),
                            on_bad_image=cfg.runtime.on_bad_image)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.inference_mode():
        if hasattr(model, "head_dist"):
            cls_logits, dist_logits = distilled_head_logits(model, images)
            fused = fuse_predictions(cls_logits, dist_logits, cfg.distill.fusion)
            heads = {"cls": cls_logits, "dist": dist_logits, "fused": fused}
        else:
            heads = {"main": model(images)}
    return {head: scores.argmax(1).numpy() for head, scores in heads.items()}


@pytest.mark.slow
def test_the_matrix_of_three_demo_runs_equals_a_redone_evaluation(tmp_path, data_cache, tiny_run, teacher_run,
                                                                   monkeypatch):
    teacher = teacher_run.run_dir("model=cnn_demo")
    data = [item for item in TINY if not item.startswith(("model.", "train.epochs="))]
    student = ["distill=hard_token", f"distill.teacher.checkpoint='{teacher}'", "model.kwargs.depth=1",
               "model.kwargs.embed_dim=32", "model.kwargs.num_heads=2", "train.epochs=1"]
    run_train(student + data, tmp_path, data_cache)
    runs = [RunDir(tiny_run.run_dir()), RunDir(teacher), RunDir(next((tmp_path / "outputs" / "runs").iterdir()))]
    saved = [load_predictions(run) for run in runs]
    for run, kept in zip(runs, saved, strict=True):
        assert kept.record["weights"] == "model" and kept.record["checkpoint"] == run.last_checkpoint.name
        assert kept.index.tolist() == list(range(kept.record["split_images"]))  # every val image, once, in order
        redone = redo_predictions(run, data_cache, monkeypatch)
        assert sorted(redone) == sorted(kept.heads)
        for head, values in redone.items():
            assert kept.heads[head].tolist() == values.tolist(), (run.name, head)
        top1 = 100 * float((kept.heads.get("main", kept.heads.get("fused")) == kept.labels).mean())
        assert top1 == pytest.approx(run.read_result()["top1"])
    assert sorted(saved[2].heads) == ["cls", "dist", "fused"]
    from_files = disagreement_matrix([v for r in saved for v in r.heads.values()])
    redone_all = [v for run in runs for v in redo_predictions(run, data_cache, monkeypatch).values()]
    np.testing.assert_allclose(from_files, disagreement_matrix(redone_all))
    assert disagreement.main([str(run.path) for run in runs] + ["--out", str(tmp_path / "table4")]) == 0
    assert (tmp_path / "table4" / "disagreement.png").exists()
