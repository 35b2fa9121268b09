"""DeiT Table 2 (which teacher) as one chained sweep: the teacher run, the distilled student, its fine-tune."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from deit_ablate.analysis.aggregate import cli
from deit_ablate.analysis.aggregate.paper import paper_table
from deit_ablate.analysis.aggregate.reader import RunInfo
from deit_ablate.analysis.aggregate.render import render, to_json_dict
from deit_ablate.analysis.aggregate.table import build_table
from deit_ablate.config.schema import DistillKind
from deit_ablate.config.studies import studies
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.rundir import RunDir, wandb_root
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.preflight import check_teacher_trained
from deit_ablate.run.stages import teacher_run_dir, teacher_run_overrides, upstream_overrides, upstream_role
from deit_ablate.run.student import student_model_name
from deit_ablate.run.teacher import check_distill_config, file_weights_digest
from hydra_plugins.deit_ablate_launcher.slurm import submission_order, upstream_jobs
from hydra_plugins.deit_ablate_launcher.sweeper import chain_order
from tests.conftest import CONF, TINY, identity_of, run_train, write_offline_runs

# Table 2 as the seeds state it (deit-blog-post "6. Which Teacher?", the chapter for RegNetY-8GF): teacher top-1,
# student at 224, student at ↑384 (None: not in the text).
TABLE2 = {"deit_b": (81.8, 81.9, 83.1), "regnety_4gf": (80.0, 82.7, 83.6), "regnety_8gf": (81.7, 82.7, None),
          "regnety_16gf": (82.9, 83.1, 84.2)}
# Each row's teacher: the model option at paper scale and its timm name, the model option at demo scale.
TEACHERS = {"deit_b": ("deit_base", "deit_base_patch16_224", "vit_demo"),
            "regnety_4gf": ("regnety_040", "regnety_040", "cnn_demo"),
            "regnety_8gf": ("regnety_080", "regnety_080", "cnn_demo"),
            "regnety_16gf": ("regnety_160", "regnety_160", "cnn_demo")}


def _hydra_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def test_the_teacher_run_is_the_students_run_with_the_teachers_model_and_no_distillation(tmp_path):
    root = f"runtime.output_root={tmp_path}"
    student = ["teachers=regnety_16gf", "stage=finetune", "resolution=48px", "finetune.lr=1e-5", "distill.alpha=0.3",
               "model.drop_path=0.2", "seed=3", "augment.reprob=0.1", root]
    cfg = _hydra_config(student)
    assert teacher_run_overrides(Lineage.of(cfg, student)) == ["model=cnn_demo", "seed=3", "augment.reprob=0.1", root]
    # At paper scale the same row chains RegNetY-16GF; the run is `python train.py model=regnety_160 ...` itself.
    paper = ["preset=paper", "teachers=regnety_16gf", "seed=3", root]
    teacher = teacher_run_overrides(Lineage.of(_hydra_config(paper), paper))
    assert teacher == ["model=regnety_160", "preset=paper", "seed=3", root]
    assert teacher_run_dir(Lineage.of(_hydra_config(paper), paper)).name == identity_of(teacher).name
    # The demo ViT teacher is the plain demo run (shared with every study's), whatever overrides name it.
    demo = ["teachers=deit_b", root]
    assert teacher_run_dir(Lineage.of(_hydra_config(demo), demo)).name.endswith(identity_of([root]).digest)
    # an unchained run has no teacher run
    assert teacher_run_overrides(Lineage.of(_hydra_config([root]), [root])) is None


def test_chain_with_a_checkpoint_or_without_distillation_is_refused():
    with pytest.raises(ConfigError, match=r"distill\.teacher\.chain=cnn_demo and distill\.teacher\.checkpoint="):
        check_distill_config(_hydra_config(["teachers=regnety_16gf", "distill.teacher.checkpoint=/tmp/x.pt"]))
    with pytest.raises(ConfigError, match="distill=none"):
        check_distill_config(_hydra_config(["distill.teacher.chain=cnn_demo"]))
    with pytest.raises(ConfigError, match="not a model option"):
        check_distill_config(_hydra_config(["distill=hard_token", "distill.teacher.chain=regnety_999"]))


def test_table2_rows_numbers_and_models_at_paper_scale():
    study = next(s for s in studies() if s.name == "teachers")
    assert study.table == "table2" and study.baseline == "regnety_16gf" and study.default is None
    assert study.rows == tuple(TABLE2)
    table = paper_table("table2")
    assert table.columns == {"pretrain": "224", "finetune": "↑384"} and table.absent == "not in the text"
    raw = json.loads((CONF / "teachers" / "numbers.json").read_text())["table2"]
    for row in raw["rows"]:
        assert (row["teacher_top1"], row["pretrain"], row["finetune"]) == TABLE2[row["key"]]
    for row, (option, timm_name, demo_option) in TEACHERS.items():
        cfg = _hydra_config(["preset=paper", f"teachers={row}"])
        assert cfg.distill.type == DistillKind.hard_token and cfg.distill.teacher.chain == option
        assert student_model_name(cfg.model, cfg.distill) == "deit_base_distilled_patch16_224"
        assert _hydra_config([f"model={option}"]).model.name == timm_name == cfg.distill.teacher.model
        assert _hydra_config([f"teachers={row}"]).distill.teacher.chain == demo_option


def test_chain_order_puts_each_teacher_run_before_its_first_student_once():
    # two students of one teacher T, one of U (finished), a plain run P
    assert chain_order(["s1", "f1", "s2", "p"], ["T", "T", "T", None], set()) == ["T", 0, 1, 2, 3]
    assert chain_order(["s1", "s2"], ["T", "U"], {"U"}) == ["T", 0, 1]
    # the teacher run listed later in the sweep moves up; listed earlier, it stays where it is
    assert chain_order(["s1", "p", "T"], ["T", None, None], set()) == [2, 0, 1]
    assert chain_order(["T", "s1"], [None, "T"], set()) == [0, 1]


def test_slurm_chains_teacher_then_student_then_finetune(tmp_path):
    common = [f"runtime.output_root={tmp_path}", *TINY]
    student = ["teachers=regnety_16gf", "stage=pretrain", *common]
    teacher = teacher_run_overrides(Lineage.of(_hydra_config(student), student))
    jobs = [teacher, student, ["teachers=regnety_16gf", "stage=finetune", *common]]
    configs = [_hydra_config(job) for job in jobs]
    assert upstream_overrides(Lineage.of(configs[1], jobs[1])) == teacher
    assert [upstream_role(Lineage.of(cfg, ())) for cfg in configs[1:]] == ["its teacher run", "its pre-training"]
    upstream = upstream_jobs(configs, jobs, lambda job: _hydra_config(job).hydra.sweep.subdir)
    assert upstream == {1: 0, 2: 1}
    assert submission_order(upstream) == [(1, 0), (2, 1)]
    # Alone, with its teacher run untrained, the student is refused before anything is queued, naming the command.
    with pytest.raises(ConfigError, match="has not finished.*python train.py model=cnn_demo"):
        upstream_jobs(configs[1:2], jobs[1:2], lambda job: _hydra_config(job).hydra.sweep.subdir)


def _heads(fused: float) -> dict[str, float]:
    """A distilled student's summary top-1s: the fused heads' (its headline top1), the class and distillation heads'."""
    return {"top1": fused, "top1_fused": fused, "top1_cls": fused - 1.0, "top1_dist": fused - 0.5}


def _student(rid: str, row: str, stage: str, top1: float, teacher: str, teacher_top1: float) -> RunInfo:
    config = {"preset": "demo", "stage": stage, "seed": 0, "ablation": "baseline", "choices": {"teachers": row}}
    summary = {"status": "finished", **_heads(top1), "teacher": {"run": teacher, "top1": teacher_top1}}
    return RunInfo(run_id=rid, config=config, summary=summary)


def test_table2_view_shows_the_teachers_top1_beside_the_students():
    runs = [_student("a", "deit_b", "pretrain", 40.0, "model=vit_demo-1", 35.5),
            _student("b", "deit_b", "finetune", 42.0, "model=vit_demo-1", 35.5),
            _student("c", "regnety_16gf", "pretrain", 45.0, "model=cnn_demo-2", 50.25)]
    table = build_table(runs, rows="teachers", only_present=True)
    text = render(table, "markdown")
    assert "teacher ours | teacher paper |" in text
    # Table 2 reads the distillation head at 224 and the class head at ↑384 (Table 3's figures): ours is that head's
    # figure (40 - 0.5, 42 - 1), named beside the paper's; one seed each: no `(n=1)`, the caption says it once
    assert re.search(r"\| deit_b \| 39\.50 · distillation head .*\| 81\.9 · distillation head \|"
                     r".*\| 41\.00 · class head .*\| 83\.1 · class head \|.*\| 35\.50 \| 81\.8 \|", text)
    assert re.search(r"\| regnety_16gf \| 44\.50 · distillation head .*\| 83\.1 · distillation head \|"
                     r".*\| 84\.2 · class head \|.*\| 50\.25 \| 82\.9 \|", text)
    record = next(r for r in to_json_dict(table)["rows"] if r["key"] == "deit_b")
    assert record["teacher_runs"] == ["model=vit_demo-1"] and record["teacher_paper"] == 81.8
    assert "teacher ours" not in render(build_table(runs, rows="stage", only_present=True), "markdown")


def _offline(rid: str, study: str, row: str, stage: str, seed: int, fused: float) -> dict:
    config = {"preset": "demo", "stage": stage, "seed": seed, "run_id": rid, "ablation": "baseline",
              "distill": {"type": "hard_token"}, "choices": {study: row}}
    summary = {"status": "finished", "top1_final": fused, **_heads(fused)}
    return {"id": rid, "root": "main", "group": study, "tags": [stage], "config": config, "summary": summary}


# DeiT-B⚗ from RegNetY-16GF at both stages, two seeds, logged once as Table 2's row and once as Table 5's (the same
# experiment: headline=deit_b_distilled and teachers=regnety_16gf share a run folder); a DeiT-B teacher row beside.
HEAD_RUNS = [
    *(_offline(f"t2-{stage}{seed}", "teachers", "regnety_16gf", stage, seed, fused)
      for stage, base in (("pretrain", 50.0), ("finetune", 60.0)) for seed, fused in ((0, base), (1, base + 2.0))),
    *(_offline(f"t5-{stage}{seed}", "headline", "deit_b_distilled", stage, seed, fused)
      for stage, base in (("pretrain", 50.0), ("finetune", 60.0)) for seed, fused in ((0, base), (1, base + 2.0))),
    _offline("t2-deitb", "teachers", "deit_b", "pretrain", 0, 40.0),
]


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HEAD_RUNS written as offline wandb runs."""
    tmp = tmp_path_factory.mktemp("heads")
    write_offline_runs(HEAD_RUNS, tmp)
    return tmp / "main" / "wandb"


def _cells(head_runs: Path, capsys, *argv: str) -> dict[str, dict]:
    assert cli.main([str(head_runs), *argv, "--format", "json"]) == 0
    return {row["key"]: row["cells"] for row in json.loads(capsys.readouterr().out)["rows"]}


def test_each_paper_number_is_shown_beside_the_same_heads_figure_of_the_same_runs(head_runs: Path, capsys):
    # Table 2: RegNetY-16GF's 83.1 at 224 is the distillation head alone, 84.2 at ↑384 the class head alone
    t2 = _cells(head_runs, capsys, "--group", "teachers", "--rows", "teachers")
    pre, fine = t2["regnety_16gf"]["pretrain"], t2["regnety_16gf"]["finetune"]
    assert (pre["mean"], pre["n"], pre["head"], pre["paper"], pre["paper_head"]) == (50.5, 2, "dist", 83.1, "dist")
    assert (fine["mean"], fine["n"], fine["head"], fine["paper"], fine["paper_head"]) == (60.0, 2, "cls", 84.2, "cls")
    deit_b = t2["deit_b"]["pretrain"]  # every row of Table 2 is read the same way, so its Δ compares one head
    assert (deit_b["mean"], deit_b["head"], deit_b["paper_head"], deit_b["delta"]) == (39.5, "dist", "dist", -11.0)
    # Table 5: the same experiment's fused heads, 83.4 / 84.5
    t5 = _cells(head_runs, capsys, "--group", "headline", "--rows", "headline")
    pre, fine = t5["deit_b_distilled"]["pretrain"], t5["deit_b_distilled"]["finetune"]
    assert (pre["mean"], pre["head"], pre["paper"], fine["mean"], fine["head"], fine["paper"]) == (
        51.0, "fused", 83.4, 61.0, "fused", 84.5)
    # another --metric is read in every cell; the paper's head stays named
    cls = _cells(head_runs, capsys, "--group", "teachers", "--rows", "teachers", "--metric", "cls")["regnety_16gf"]
    assert (cls["pretrain"]["mean"], cls["pretrain"]["head"], cls["pretrain"]["paper_head"]) == (50.0, "cls", "dist")
    ema = _cells(head_runs, capsys, "--group", "teachers", "--rows", "teachers", "--metric", "ema")["regnety_16gf"]
    assert (ema["pretrain"]["state"], ema["pretrain"]["head"], ema["pretrain"]["paper_head"]) == ("n/a", None, "dist")


def test_the_markdown_names_each_head_and_says_the_heads_are_an_inference(head_runs: Path, capsys):
    assert cli.main([str(head_runs), "--group", "teachers", "--rows", "teachers"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| regnety_16gf |"))
    assert "| 50.50 ± 1.41 (n=2) · distillation head |" in row and "| 83.1 · distillation head |" in row
    assert "| 60.00 ± 1.41 (n=2) · class head |" in row and "| 84.2 · class head |" in row
    assert ("Heads: where the paper's number is one head's of a ⚗ model, ours beside it is the same head's figure "
            "(pre-train, distillation head: deit_b, regnety_4gf, regnety_8gf, regnety_16gf; fine-tune, class head: "
            "deit_b, regnety_4gf, regnety_16gf)") in text
    assert "an inference from the numbers of Table 3" in text  # the table's heads note, in the footnotes
    assert cli.main([str(head_runs), "--group", "headline", "--rows", "headline"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| deit_b_distilled |"))
    assert "| 51.00 ± 1.41 (n=2) · fused heads |" in row and "| 83.4 · fused heads |" in row


def test_a_bad_head_in_a_numbers_file_is_one_clear_error():
    from deit_ablate.analysis.aggregate.paper import _heads

    raw = {"group": "teachers", "heads": {"finetune": "cls"}}
    assert _heads(raw, "table2", {"key": "x", "heads": {"pretrain": "dist"}}) == {"pretrain": "dist"}
    assert _heads(raw, "table2", {"key": "x"}) == {"finetune": "cls"}  # the table's, where the row names none
    with pytest.raises(ValueError, match=r"conf/teachers/numbers.json: table table2, row x: `heads` \{'pretrain': "
                                         r"'distillation'\} is not a map of stage"):
        _heads(raw, "table2", {"key": "x", "heads": {"pretrain": "distillation"}})


@pytest.mark.slow
def test_dry_run_shows_the_chain_in_order(tmp_path, data_cache):
    proc = run_train(["-m", "teachers=deit_b,regnety_16gf", "stage=pretrain,finetune", "runtime.dry_run=true",
                      *TINY], tmp_path, data_cache)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[dry run]")]
    assert len(lines) == 6
    chains = (("model=vit_demo", "teachers=deit_b"), ("model=cnn_demo", "teachers=regnety_16gf"))
    for i, (teacher, row) in enumerate(chains):
        first, student, finetune = lines[3 * i: 3 * i + 3]
        teacher_run = first.split()[2]
        student_run = student.split()[2]
        assert teacher in teacher_run and first.endswith("train from step 0")
        assert student_run.startswith(row) and student.endswith(f"wait for its teacher run {teacher_run}")
        assert finetune.endswith(f"wait for its pre-training {student_run}")
    assert not (tmp_path / "outputs" / "runs").exists()  # a dry run writes nothing


def test_a_single_launch_of_a_student_without_its_teacher_run_names_the_command(tmp_path, capsys):
    # preflight's check of `python train.py teachers=regnety_16gf` (no sweep to train the teacher run first)
    cfg = _hydra_config(["teachers=regnety_16gf", f"runtime.output_root={tmp_path}"])
    with pytest.raises(SystemExit) as stopped:
        check_teacher_trained(cfg)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "has not finished" in error and f"python train.py model=cnn_demo runtime.output_root={tmp_path}" in error
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_two_teacher_sweep_trains_teachers_then_students_then_finetunes(tmp_path, data_cache, capsys):
    tiny = [*TINY, "finetune.epochs=1", "train.max_steps=4"]
    run_train(["-m", "teachers=deit_b,regnety_16gf", "stage=pretrain,finetune", *tiny], tmp_path, data_cache)
    outputs = tmp_path / "outputs"
    for row, model in (("deit_b", "model=vit_demo"), ("regnety_16gf", "model=cnn_demo")):
        student = RunDir.under(outputs, _one(outputs, f"teachers={row},", "finetune", absent=True))
        finetune = RunDir.under(outputs, _one(outputs, f"teachers={row},", "finetune"))
        teacher = RunDir.under(outputs, _one(outputs, model, ""))
        recorded = student.read_result()["teacher"]
        assert recorded["run"] == teacher.name and recorded["top1"] == teacher.read_result()["top1"]
        assert recorded["digest"] == file_weights_digest(teacher.weights())
        assert finetune.read_result()["teacher"]["digest"] == recorded["digest"]  # the fine-tune distils from it too
        # teacher, then student, then fine-tune
        times = [run.result.stat().st_mtime_ns for run in (teacher, student, finetune)]
        assert times == sorted(times)
    assert cli.main([str(wandb_root(outputs)), "--rows", "teachers", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    rows = {row["key"]: row for row in table["rows"]}
    for row in ("deit_b", "regnety_16gf"):
        assert rows[row]["cells"]["pretrain"]["n"] == 1 and rows[row]["cells"]["finetune"]["n"] == 1
        assert rows[row]["cells"]["pretrain"]["paper"] == TABLE2[row][1]
        assert rows[row]["teacher_paper"] == TABLE2[row][0] and len(rows[row]["teacher_top1"]) == 1


def _one(outputs: Path, fragment: str, other: str, absent: bool = False) -> str:
    """The one run folder whose name holds `fragment`, and `other` (or not, `absent`)."""
    names = [p.name for p in (outputs / "runs").iterdir() if p.is_dir() and fragment in p.name
             and (other not in p.name if absent else other in p.name)]
    assert len(names) == 1, names
    return names[0]


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch: start the cluster with scripts/slurm_up.sh")
def test_a_slurm_submission_chains_teacher_student_and_finetune_with_afterok(tmp_path, data_cache):
    slurm = ["hydra/launcher=slurm_8gpu", "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=2",
             "hydra.launcher.timeout_min=20"]
    proc = run_train(["-m", "teachers=regnety_16gf", "stage=pretrain,finetune", "finetune.epochs=1",
                      "train.max_steps=2", *slurm, *TINY], tmp_path, data_cache, timeout=900)
    log = proc.stdout + proc.stderr
    assert re.search(r"#0 : model=cnn_demo ", log)  # the teacher run, added by the sweeper, queued first
    student = re.search(r"#1 waits for job (\d+) \(its teacher run\)", log)
    finetune = re.search(r"#2 waits for job (\d+) \(its pre-training\)", log)
    assert student and finetune and int(finetune.group(1)) > int(student.group(1))
    outputs = tmp_path / "outputs"
    teacher = RunDir.under(outputs, _one(outputs, "model=cnn_demo", ""))
    pretrain = RunDir.under(outputs, _one(outputs, "teachers=regnety_16gf,", "finetune", absent=True))
    tuned = RunDir.under(outputs, _one(outputs, "teachers=regnety_16gf,", "finetune"))
    assert pretrain.read_result()["teacher"]["run"] == teacher.name
    times = [run.result.stat().st_mtime_ns for run in (teacher, pretrain, tuned)]
    assert times == sorted(times) and tuned.read_result()["status"] == "finished"


REGNETS = ("regnety_4gf", "regnety_8gf", "regnety_16gf")


def test_the_three_regnet_rows_are_three_demo_experiments_ordered_by_size(tmp_path):
    import timm

    root = f"runtime.output_root={tmp_path}"
    students = [identity_of([f"teachers={row}"]) for row in REGNETS]
    assert len({s.digest for s in students}) == 3 and len({s.run_id for s in students}) == 3
    assert students[2].name == "teachers=regnety_16gf-761e8f6860"  # the 16GF row's demo teacher is the demo CNN
    teachers = [teacher_run_overrides(Lineage.of(_hydra_config([f"teachers={row}", root]), [f"teachers={row}", root]))
                for row in REGNETS]
    assert teachers[2] == ["model=cnn_demo", root]
    assert len({identity_of(t).digest for t in teachers}) == 3  # three teacher runs
    sizes = []
    for overrides in teachers:
        model = _hydra_config(overrides).model
        assert model.name == "resnet10t"
        net = timm.create_model(model.name, num_classes=10, **model.kwargs)
        sizes.append(sum(p.numel() for p in net.parameters()))
    assert sizes[0] < sizes[1] < sizes[2]  # 4 < 8 < 16 GF
    # the paper scale: the RegNetY runs themselves; the students' hashes hold their teacher run's digest
    paper = {"regnety_4gf": "213c4e08c7", "regnety_8gf": "922da88263", "regnety_16gf": "8820d1c497"}
    for row, option in zip(REGNETS, ("regnety_040", "regnety_080", "regnety_160"), strict=True):
        overrides = ["preset=paper", f"teachers={row}"]
        assert identity_of(overrides).name == f"preset=paper,teachers={row}-{paper[row]}"
        lineage = Lineage.of(_hydra_config(overrides), overrides)
        assert teacher_run_overrides(lineage) == [f"model={option}", "preset=paper"]


def _plan(overrides: list[str], tmp_path: Path):
    from deit_ablate.core.distributed import DistInfo
    from deit_ablate.run.plan import make_plan

    return make_plan(_hydra_config(overrides), DistInfo(), RunDir.under(tmp_path, identity_of(overrides).name),
                     overrides)


def _finished_teacher_run(run: RunDir) -> None:
    """A finished demo CNN teacher run in `run`'s folder: its config, result and best weights."""
    import timm
    import torch
    import yaml

    run.hydra_config.parent.mkdir(parents=True)
    run.hydra_config.write_text(yaml.safe_dump({"model": {"name": "resnet10t", "kwargs": {}}, "stage": "pretrain"}))
    run.result.write_text(json.dumps({"status": "finished", "run_id": "0123456789abcdef", "top1": 50.0}))
    torch.save({"model": timm.create_model("resnet10t", num_classes=10).state_dict()}, run.best_checkpoint)


def test_a_dry_run_prints_the_wandb_id_the_student_will_have_or_says_it_waits_for_its_teacher(tmp_path):
    from deit_ablate.run.lifecycle import dry_run_line

    student = ["teachers=regnety_16gf", f"runtime.output_root={tmp_path}"]
    dry = _plan([*student, "runtime.dry_run=true"], tmp_path)
    line = dry_run_line(dry)
    # the teacher run has not trained: the id is pending its weights, not the id of a student without a teacher
    assert "(wandb id pending: keyed by its teacher run's weights digest)" in line, line
    assert dry.identity.run_id not in line and line.endswith(f"wait for its teacher run {dry.teacher_run.name}")
    _finished_teacher_run(dry.teacher_run)
    dry, real = _plan([*student, "runtime.dry_run=true"], tmp_path), _plan(student, tmp_path)
    assert real.identity.teacher is not None and dry.identity.run_id == real.identity.run_id
    assert f"(wandb id {real.identity.run_id})" in dry_run_line(dry)
