"""DDP over Gloo on this CPU: 2 processes at the same global batch make the same first update as 1."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from deit_ablate.core.errors import ConfigError
from deit_ablate.record.rundir import LOCK, RESULT, RunDir, runs_root
from tests.conftest import REPO, TINY, run_train

# Deterministic input: no crop/flip/RandAugment/erasing/repeats, no mixing, no drop path.
DETERMINISTIC = ["augment=none", "augment.no_aug=true", "mix=none", "model.drop_path=0", "train.max_steps=1"]


def test_two_processes_make_the_same_first_update_as_one(tmp_path, data_cache):
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(DETERMINISTIC + TINY + [f"hydra.run.dir={one}"], tmp_path, data_cache)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
                str(REPO / "train.py")]
    proc = run_train(DETERMINISTIC + TINY + [f"hydra.run.dir={two}"], tmp_path, data_cache, module=torchrun)
    assert re.search(r"rank 1 of 2 \(local rank 1 on .+\) joined the process group \(gloo, cpu\)", proc.stdout)
    assert "global batch 32 = 4 micro-batches of 8 (virtual slots), 2 per rank and step" in proc.stdout
    assert "4 micro-batches of 8 (virtual slots), 2 per rank" in RunDir(two).log.read_text()  # each rank's own log
    assert RunDir(two).rank_log(1).exists() and not list(two.glob(f"{LOCK}*"))
    a = torch.load(RunDir(one).last_checkpoint, weights_only=True)
    b = torch.load(RunDir(two).last_checkpoint, weights_only=True)
    assert a["step"] == b["step"] == 1
    # Equal only if DDP averaged the two halves' gradients: each half alone gives another update.
    for name, tensor in a["model"].items():
        assert torch.allclose(tensor, b["model"][name], atol=1e-6, rtol=1e-5), name


@pytest.mark.slow
def test_eval_max_images_scores_the_same_images_on_one_process_and_on_two(tmp_path, data_cache):
    # train.eval_max_batches counted batches of runtime.eval_batch per rank: two ranks scored twice the images of one
    # process. train.eval_max_images is the whole run's count: the first 30 of the split's 100 on any layout.
    one, two = tmp_path / "one", tmp_path / "two"
    args = DETERMINISTIC + TINY + ["train.eval_max_images=30", "runtime.eval_batch=7"]
    run_train(args + [f"hydra.run.dir={one}"], tmp_path, data_cache)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29535",
                str(REPO / "train.py")]
    run_train(args + [f"hydra.run.dir={two}"], tmp_path, data_cache, module=torchrun)
    (a, _), (b, _) = RunDir(one).read_predictions(), RunDir(two).read_predictions()
    assert list(a["index"]) == list(b["index"]) == list(range(30))
    assert (a["main"] == b["main"]).all()
    top1 = [json.loads(RunDir(run).result.read_text())["top1"] for run in (one, two)]
    assert top1[0] == pytest.approx(top1[1])


def test_eval_max_batches_counted_per_rank_is_refused_naming_eval_max_images():
    from deit_ablate.run.validate import validate_config
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=r"train.eval_max_batches=3 .* Set train.eval_max_images=N instead"):
        validate_config(compose_config(["train.eval_max_batches=3"]))


def test_eval_mode_finetune_of_a_distilled_student_runs_two_ddp_steps(tmp_path, data_cache):
    # The fine-tune trains in eval mode (released DeiT code) while the distilled student must still return both
    # heads: every parameter gets a gradient, or DDP fails at its second step.
    import timm

    teacher = tmp_path / "teacher.pt"
    torch.save({"model": timm.create_model("resnet10t", num_classes=10).state_dict()}, teacher)
    student = TINY + ["distill=hard_token", f"distill.teacher.checkpoint={teacher}", "train.max_steps=2"]
    run_train(student, tmp_path, data_cache)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29534",
                str(REPO / "train.py")]
    proc = run_train(student + ["stage=finetune"], tmp_path, data_cache, module=torchrun)
    assert "finetune at 48px of deit_tiny_distilled_patch16_224 (patch 8, width 32, depth 1, heads 2, " in proc.stdout
    assert " M params) (in eval mode)" in proc.stdout
    results = [json.loads(p.read_text()) for p in (runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}")]
    assert len(results) == 2  # the pre-training and its fine-tune
    assert all(r["status"] == "finished" and r["steps_done"] == 2 and "top1_dist" in r for r in results)


def _agree_when_rank_0_fails(rank: int, store: str, results: str) -> None:
    import torch.distributed as dist

    from deit_ablate.core.distributed import DistInfo, agree
    from deit_ablate.core.errors import RunError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def decide() -> None:
        raise PermissionError("cannot read /data/x")

    try:
        agree(DistInfo(rank=rank, world_size=2), decide)
        outcome = "returned"
    except RunError as error:
        outcome = f"RunError: {error}"
    except PermissionError:
        outcome = "PermissionError"
    finally:
        dist.destroy_process_group()
    with open(f"{results}.{rank}", "w") as f:
        f.write(outcome)


def test_an_unexpected_error_of_rank_0_stops_the_other_ranks_instead_of_leaving_them_waiting(tmp_path):
    import torch.multiprocessing as mp

    results = str(tmp_path / "outcome")
    mp.spawn(_agree_when_rank_0_fails, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    assert (tmp_path / "outcome.0").read_text() == "PermissionError"
    assert (tmp_path / "outcome.1").read_text() == ("RunError: rank 0 failed (PermissionError: cannot read /data/x); "
                                                    "see its log")


class _NeedsTwoArguments(ConfigError):
    """An error class that pickle cannot build again (its __init__ takes other arguments than its message)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def _errors_that_cross_agree(garbage: str) -> dict:
    """Each error class a function run by `agree` raises (the last one falls back to a ConfigError with its text),
    with the error raised: a teacher checkpoint that cannot be read is a real CheckpointUnreadable."""
    from deit_ablate.core.errors import RunError
    from deit_ablate.record.checkpoint import CheckpointUnreadable, load
    from deit_ablate.train.teacher import TeacherLoadError

    def unreadable_teacher():
        load(garbage, f"The teacher checkpoint {garbage}")

    def raising(error):
        def decide():
            raise error
        return decide

    return {"CheckpointUnreadable": (unreadable_teacher, CheckpointUnreadable),
            "ConfigError": (raising(ConfigError("data.root=/x does not exist")), ConfigError),
            "RunError": (raising(RunError("no space left on the device")), RunError),
            "TeacherLoadError": (raising(TeacherLoadError("a 5-class head")), TeacherLoadError),
            "unpicklable": (raising(_NeedsTwoArguments("the plan", "it cannot be built again")), ConfigError)}


def _what_agree_raised(info, garbage: str) -> dict[str, list]:
    """Per case of _errors_that_cross_agree: the class name, message and path attribute of what `agree` raised."""
    from deit_ablate.core.distributed import agree

    seen = {}
    for name, (decide, _) in _errors_that_cross_agree(garbage).items():
        try:
            agree(info, decide)
            seen[name] = ["returned", "", None]
        except Exception as error:  # noqa: BLE001 - the test records whatever came
            seen[name] = [type(error).__name__, str(error), str(getattr(error, "path", None))]
    return seen


def _agree_each_error(rank: int, store: str, garbage: str, results: str) -> None:
    import torch.distributed as dist

    from deit_ablate.core.distributed import DistInfo

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        seen = _what_agree_raised(DistInfo(rank=rank, world_size=2), garbage)
    finally:
        dist.destroy_process_group()
    with open(f"{results}.{rank}", "w") as f:
        json.dump(seen, f)


def _check_what_agree_raised(seen: dict[str, list], garbage: str, other_rank: bool) -> None:
    """Each error arrived with its class, message and path; on another rank than rank 0, the one that does not pickle
    is a ConfigError with its text (rank 0 raises it itself)."""
    for name, (_, expected) in _errors_that_cross_agree(garbage).items():
        kind = seen[name][0]
        assert kind == (expected.__name__ if other_rank or name != "unpicklable" else "_NeedsTwoArguments"), seen[name]
    assert seen["CheckpointUnreadable"][1].startswith(f"The teacher checkpoint {garbage} cannot be read: ")
    assert seen["CheckpointUnreadable"][2] == garbage
    assert seen["unpicklable"][1] == "the plan: it cannot be built again"
    assert seen["ConfigError"][1] == "data.root=/x does not exist"


def test_every_error_class_that_crosses_agree_arrives_whole_on_one_rank_and_on_two(tmp_path):
    import torch.multiprocessing as mp

    from deit_ablate.core.distributed import DistInfo

    garbage = tmp_path / "teacher.pth"
    garbage.write_bytes(bytes(range(256)) * 8)
    alone = _what_agree_raised(DistInfo(), str(garbage))
    _check_what_agree_raised(alone, str(garbage), other_rank=False)
    results = str(tmp_path / "seen")
    mp.spawn(_agree_each_error, args=(str(tmp_path / "store"), str(garbage), results), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"seen.{rank}").read_text()) for rank in (0, 1)]
    assert seen[0] == alone  # rank 0 raises what it raised alone
    _check_what_agree_raised(seen[1], str(garbage), other_rank=True)
    assert {name: seen[1][name] for name in alone if name != "unpicklable"} == \
        {name: alone[name] for name in alone if name != "unpicklable"}


@pytest.mark.slow
def test_a_world_size_the_batch_cannot_take_is_refused_once_and_leaves_nothing(tmp_path, data_cache):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--master_port=29535",
                str(REPO / "train.py")]
    slots_of_2 = [o for o in TINY if not o.startswith("train.micro_batch=")] + ["train.micro_batch=16"]
    proc = run_train(slots_of_2, tmp_path, data_cache, module=torchrun, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("cannot be dealt equally over 3 processes") == 1, proc.stderr[-3000:]  # it was 3
    assert not (tmp_path / "outputs").exists(), list(tmp_path.rglob("*"))  # it left an empty outputs/runs/
