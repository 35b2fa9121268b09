"""The benchmark sections scripts/bench.py runs, each adding figures and comparisons to a Report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deit_ablate.bench.compose import TRAIN_PY, compose_run
from deit_ablate.bench.env import matmul_rate, matmul_setting
from deit_ablate.bench.report import Figure, Report, median
from deit_ablate.bench.whole_run import JpegRun
from deit_ablate.data.transforms import TransformSpec

SECTIONS = ("matmul", "step", "host_step", "pipeline", "workers", "e2e", "e2e_run", "startup")


@dataclass
class Settings:
    """What a bench invocation measures, and how hard."""

    device: torch.device
    cache: Path
    command: str
    quick: bool = False
    repeats: int = 3
    timm_train: Path | None = None
    model: str = "vit_demo"
    size: int = 32
    batch: int = 128
    compile: bool = False
    jpeg_count: int = 1024
    pipeline_batch: int = 64
    e2e_steps: int = 30
    e2e_warmup: int = 5
    e2e_batch: int = 128
    e2e_epochs: int = 4  # whole runs of the e2e_run section
    e2e_micro_batch: int | None = None  # our side's train.micro_batch (None: the demo's 32; 128: timm's one batch)
    workers: int | None = None  # None: a run's default on this device (data/loader.py loader_settings)
    jpeg_run: JpegRun | None = None  # e2e_run: a model at a size on JPEGs (None: the demo on built-in data)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device_name(self) -> str:
        return self.device.type


def _log(message: str) -> None:
    print(message, flush=True)


def _workers(s: Settings) -> int:
    from deit_ablate.config.schema import RuntimeConfig
    from deit_ablate.data.loader import default_num_workers, loader_settings

    if s.workers is not None:
        return s.workers
    return loader_settings(RuntimeConfig(), s.device.type, default_num_workers()).workers


def builtin_root(s: Settings) -> str:
    """Where the built-in dataset lives (data.root for data=builtin)."""
    return str(s.cache / "builtin")


def builtin_overrides(s: Settings) -> list[str]:
    """The built-in dataset: where it is cached, and a 300-image version under --quick."""
    small = ["data.builtin.train_per_class=30", "data.builtin.val_per_class=10"] if s.quick else []
    return [f"data.root={builtin_root(s)}", *small]


def section_matmul(s: Settings, report: Report) -> None:
    """Dense matmul FLOP/s: the peak MFU is quoted against (bf16 on GPU, fp32 on CPU)."""
    n = 512 if s.quick else None
    rate = matmul_rate(s.device, n=n, repeats=5 if s.quick else 10)
    report.add(Figure("matmul_rate", rate["dtype"], rate["flops_per_s"] / 1e9, "GFLOP/s", report.device["summary"],
                      s.command, {"n": rate["n"], "dtype": rate["dtype"], "statistic": "best of repeats"},
                      [x / 1e9 for x in rate["samples_flops_per_s"]]))


def section_step(s: Settings, report: Report) -> None:
    """Our Trainer.train_step on uint8 loader batches; optimizer implementations, compile and host syncs per step."""
    from deit_ablate.bench import step

    overrides = [f"model={s.model}", f"resolution.train_size={s.size}", f"resolution.eval_size={s.size}",
                 f"train.global_batch={s.batch}", f"train.micro_batch={s.batch}",
                 f"runtime.max_batch_per_device={s.batch}", "runtime.num_workers=0",
                 *builtin_overrides(s), f"runtime.device={s.device_name}"]
    cfg = compose_run(overrides)
    variants: dict[str, dict[str, Any]] = {"ours": {}}
    if not s.quick:  # the default is whatever optim.build_optimizer asks torch for; these force one implementation
        variants["ours+forloop_adamw"] = {"optimizer_impl": "forloop"}
        variants["ours+foreach_adamw"] = {"optimizer_impl": "foreach"}
        variants["ours+fused_adamw"] = {"optimizer_impl": "fused"}
        if s.device.type == "cpu" and torch.get_num_threads() > 1:
            variants["ours/threads=1"] = {"threads": 1}
    if s.compile:
        variants["ours+compile"] = {"compile_model": True}
    steps, warmup = (3, 2) if s.quick else (10 if s.device.type == "cpu" else 30, 5)
    rates, setups = step.measure(overrides, s.device, variants, steps, 1 if s.quick else s.repeats, warmup, _log)
    flops = step.train_flops_per_image(setups["ours"].trainer.model, s.size, s.device)
    peak = report.get("matmul_rate", str(matmul_setting(s.device)[0]).removeprefix("torch."))
    syncs = step.count_syncs_per_step(setups["ours"])
    for name, samples in rates.items():
        value = median(samples)
        extra = {"train_flops_per_image": flops, "achieved_tflops_per_s": flops * value / 1e12,
                 "steps_per_sample": steps, "warmup_steps": warmup}
        if peak is not None:
            extra["mfu"] = flops * value / (peak.value * 1e9)
            extra["mfu_reference"] = f"measured {peak.variant} matmul {peak.value:.0f} GFLOP/s"
        if name == "ours":
            extra["host_syncs_per_step"] = syncs
            extra["optimizer_runs_as"] = step.default_optimizer_impl(setups[name].trainer.optimizer)
        settings = {**step.step_settings(cfg.model, cfg.resolution, setups[name]), "overrides": overrides}
        report.add(Figure("train_step", name, value, "images/s", report.device["summary"],
                          f"{s.command}  (in-process: Trainer.train_step on uint8 loader batches)", settings, samples,
                          extra))
    for name in variants:
        if name != "ours":
            report.compare("train_step", name, "ours")
    impls = {name: setup for name, setup in setups.items() if not setup.compiled and setup.threads is None}
    if len(impls) > 1:
        optimizer_s = step.optimizer_step_seconds(impls, 20, max(s.repeats, 5))
        for name, samples in optimizer_s.items():
            ms = [x * 1e3 for x in samples]
            report.add(Figure("optimizer_step", name, median(ms), "ms", report.device["summary"],
                              f"{s.command}  (in-process: optimizer.step() on random gradients)",
                              step.step_settings(cfg.model, cfg.resolution, impls[name]), ms,
                              {"runs_as": step.default_optimizer_impl(impls[name].trainer.optimizer)}))
        for name in impls:
            if name != "ours":
                report.compare("optimizer_step", name, "ours", lower_is_better=True)


def section_host_step(s: Settings, report: Report) -> None:
    """The host's share of a step, ours against timm's loop, and the loader per worker core (bench/host_step.py)."""
    from deit_ablate.bench import host_step
    host_step.section(report, s.command, s.device, s.quick, s.repeats, builtin_root(s), _pipeline_loader_note, _log)


def section_pipeline(s: Settings, report: Report) -> None:
    """Our training transform + DataLoader on 500x375 JPEGs at 224 px: default, fast JPEG path, the DALI backend
    (on the device: the CPU here, the GPU where there is one), timm's loader."""
    from deit_ablate.bench import pipeline
    from deit_ablate.data.transforms import build_train_pipeline

    count, batch = (48, 16) if s.quick else (s.jpeg_count, s.pipeline_batch)
    _log(f"[bench] JPEG set: {count} images of {pipeline.JPEG_WIDTH}x{pipeline.JPEG_HEIGHT} ...")
    root = pipeline.ensure_jpeg_set(count)
    workers = _workers(s)
    overrides = ["resolution=224px", f"runtime.num_workers={workers}", f"data.root={builtin_root(s)}"]
    spec = pipeline.loader_setup(overrides).spec
    loaders = _pipeline_loaders(s, root, overrides, spec, batch, workers)
    results = pipeline.alternate_loaders(loaders, 1 if s.quick else s.repeats, log=_log)
    for name, rows in results.items():
        n_workers = 0 if name.endswith("1-process") else workers
        samples = [row["images_per_s"] for row in rows]
        value = median(samples)
        settings = {"images": str(root), "image_size": f"{pipeline.JPEG_WIDTH}x{pipeline.JPEG_HEIGHT} JPEG q90",
                    "train_size": 224, "batch": batch, "workers": n_workers, "transform": "DeiT: RRC, flip, "
                    "rand-m9-mstd0.5-inc1, normalize, random erasing 0.25 pixel", "overrides": overrides,
                    "loader": _pipeline_loader_note(name)}
        report.add(Figure("input_pipeline", name, value, "images/s", report.device["summary"],
                          f"{s.command}  (in-process: DataLoader over {count} JPEGs)", settings, samples,
                          {"per_worker_images_per_s": value / max(n_workers, 1),
                           "first_batch_s": median([row["first_batch_s"] for row in rows])}))
    _compare_pipelines(report)
    _add_stage_costs(s, report, root, *build_train_pipeline(spec), count)
    _add_crop_difference(s, report, root, count)


def _pipeline_loaders(s: Settings, root: Path, overrides: list[str], spec: TransformSpec, batch: int,
                      workers: int) -> dict[str, Any]:
    """The input_pipeline variants, by name: ours, fast JPEG, DALI where importable, timm's transform and loader,
    without the per-batch step (CPU), and each held to one process."""
    from deit_ablate.bench import pipeline
    from deit_ablate.data.dali import dali_available

    paths = {"ours": [], "ours+fast_jpeg": ["data.fast_jpeg=true"], "timm_transform": []}
    if dali_available():
        paths["dali"] = ["data.backend=dali"]
    else:
        _log("[bench] DALI is not importable: no dali variant (bash scripts/install.sh installs it)")

    def loader(name: str, n_workers: int = workers) -> pipeline.Loader:
        setup = pipeline.loader_setup([*overrides, f"runtime.num_workers={n_workers}", *paths[name]])
        dataset, batch_step = pipeline.jpeg_dataset(root, setup, whole_timm_transform=name == "timm_transform")
        return pipeline.our_loader(setup, dataset, batch, batch_step, s.device)

    loaders: dict[str, Any] = {"ours": loader("ours"), "ours+fast_jpeg": loader("ours+fast_jpeg")}
    if "dali" in paths:
        loaders["dali"] = loader("dali")
    if not s.quick:
        loaders["timm_transform"] = loader("timm_transform")
    if s.device.type == "cpu" and not s.quick:  # what the workers deliver when the per-batch step runs on a GPU
        for name in ("ours", "ours+fast_jpeg"):
            loaders[f"{name}/no-batch-step"] = pipeline.Loader(loaders[name].loader, None, s.device)
    if s.timm_train is not None and not s.quick:
        loaders["timm_loader"] = pipeline.timm_loader(root, spec, batch, workers)
    if not s.quick and workers > 0:
        for name in paths:  # one core, as a worker
            loaders[f"{name}/1-process"] = loader(name, n_workers=0).one_thread()
    return loaders


def _compare_pipelines(report: Report) -> None:
    """The input_pipeline ratios the targets are read from (absent variants are left out by Report.compare)."""
    report.compare("input_pipeline", "ours+fast_jpeg", "ours", target=1.5)
    report.compare("input_pipeline", "ours+fast_jpeg/1-process", "ours/1-process", target=1.5)
    report.compare("input_pipeline", "ours+fast_jpeg/no-batch-step", "ours/no-batch-step")
    report.compare("input_pipeline", "ours", "timm_transform")
    report.compare("input_pipeline", "ours/1-process", "timm_transform/1-process")
    # The 1.5x was set against timm's per-image transform, the default path before the uint8 split.
    report.compare("input_pipeline", "ours+fast_jpeg", "timm_transform", target=1.5)
    report.compare("input_pipeline", "ours+fast_jpeg/1-process", "timm_transform/1-process", target=1.5)
    report.compare("input_pipeline", "ours", "timm_loader")
    report.compare("input_pipeline", "dali", "ours")
    report.compare("input_pipeline", "dali/1-process", "ours/1-process")
    report.compare("input_pipeline", "dali", "timm_loader")


def _add_crop_difference(s: Settings, report: Report, root: Path, count: int) -> None:
    """How far the fast crop's pixels lie from timm's for the same random draws."""
    from deit_ablate.bench import pipeline

    images = min(count, 48 if s.quick else 200)
    difference = pipeline.crop_difference(root, images)
    for variant in ("full_scale", "reduced_scale"):
        report.add(Figure("fast_crop_pixel_difference", variant, difference[variant], "grey levels",
                          report.device["summary"], f"{s.command}  (in-process: fast crop vs timm's, same draws)",
                          {"images": images, "train_size": 224, "keep": "default"}, [difference[variant]],
                          {"reduced_share": difference["reduced_share"],
                           "what": "mean |fast - timm| over the crops decoded at this scale, before RandAugment"}))


def _pipeline_loader_note(name: str) -> str:
    """How the loader of an input_pipeline variant is built."""
    if name == "timm_loader":
        return "timm create_loader, prefetcher"
    if name.startswith("timm_transform"):
        return "our build_loader, timm's create_transform whole per image (to-tensor, normalize, erasing in workers)"
    if name.startswith("dali"):
        return ("data.backend=dali: DALI pipeline (decode, crop, flip, RandAugment; threads = workers, 1 for "
                "1-process) fed our sampler's order, + BatchNormalize on the batch in this process")
    if name.endswith("no-batch-step"):
        return "our build_loader, uint8 batches as the workers deliver them (BatchNormalize left to a GPU)"
    return "our build_loader + BatchNormalize on the batch in this process"


def _add_stage_costs(s: Settings, report: Report, root: Path, per_image: Any, per_batch: Any, count: int) -> None:
    """Where one image's time goes on the default path, and what a free decode (and crop) could gain."""
    from deit_ablate.bench import pipeline

    images = min(count, 48 if s.quick else 300)
    costs = pipeline.stage_costs(root, per_image, images, repeats=1 if s.quick else 2, batch_step=per_batch)
    command = f"{s.command}  (in-process: each step of the default path timed, one thread)"
    settings = {"images": images, "statistic": "best of repeats, ms per image", "torch_threads": 1}
    for stage, ms in costs.items():
        report.add(Figure("transform_stage", stage, ms, "ms/image", report.device["summary"], command, settings,
                          [ms], {"share": ms / sum(costs.values())}))
    crop = next((name for name in costs if "ResizedCrop" in name), None)
    for variant, free in (("decode_free", ("decode",)), ("decode_and_crop_free", ("decode", crop))):
        bound = pipeline.speedup_bound(costs, free)
        report.add(Figure("speedup_bound", variant, bound, "x", report.device["summary"], command,
                          {**settings, "free_stages": [f for f in free if f]}, [bound],
                          {"what": "Amdahl bound of the default transform if these stages cost nothing"}))


def section_workers(s: Settings, report: Report) -> None:
    """Worker startup per epoch at the demo scale, ours (started once, reseeded) against torch's persistent workers
    and workers started each epoch, and whether resume stays exact with each."""
    from deit_ablate.bench import pipeline
    from deit_ablate.data.datasets import dataset_root

    workers = _workers(s)
    overrides = [f"runtime.num_workers={workers}", *builtin_overrides(s)]
    cfg, setup = compose_run(overrides), pipeline.loader_setup(overrides)
    dataset, _ = pipeline.jpeg_dataset(dataset_root(cfg.data), setup)  # the built-in set, as run.py builds it
    epochs = 2 if s.quick else 3
    kinds = ("ours", "persistent", "per_epoch")  # ours: started once, reseeded per epoch (data/loader.py)
    rows: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for _ in range(1 if s.quick else max(s.repeats - 1, 1)):
        for kind in kinds:
            rows[kind] += pipeline.worker_startup(setup, dataset, cfg.train.global_batch, epochs, kind)[1:]
    for kind, samples in rows.items():
        first = [row["first_batch_s"] for row in samples]
        exact = pipeline.resume_exact_with_workers(kind, max(workers, 1))
        report.add(Figure("epoch_start_latency", f"workers={kind}", median(first), "s",
                          report.device["summary"], f"{s.command}  (in-process: demo-scale epochs, run.py reseeding)",
                          {"workers": workers, "batch": cfg.train.global_batch, "epochs_per_sample": epochs,
                           "dataset": f"built-in, {len(dataset)} images at 40 px", "overrides": overrides}, first,
                          {"epoch_s": median([row["epoch_s"] for row in samples]),
                           "exact_resume_with_workers": exact}))
    report.compare("epoch_start_latency", "workers=ours", "workers=per_epoch", lower_is_better=True)


def e2e_overrides(s: Settings, workers: int, repeated_aug: bool) -> list[str]:
    """Our side of the end-to-end comparison: the demo preset on the built-in data."""
    overrides = [*builtin_overrides(s), f"runtime.num_workers={workers}", f"runtime.device={s.device_name}",
                 f"augment.repeated_aug={3 if repeated_aug else 1}"]
    if s.e2e_batch != 128:  # a smaller batch scales the lr down: keep the (unused) fine-tune schedule valid
        overrides += [f"train.global_batch={s.e2e_batch}", f"train.micro_batch={s.e2e_batch}",
                      f"runtime.max_batch_per_device={s.e2e_batch}",
                      "finetune.min_lr=1e-6"]
    if s.e2e_micro_batch is not None:
        overrides.append(f"train.micro_batch={s.e2e_micro_batch}")
    return overrides


def section_e2e(s: Settings, report: Report) -> None:
    """Short real runs of our train.py and timm's train.py, alternately; steady rate, data wait, compute rate."""
    from deit_ablate.bench import runs, timm_ref
    from deit_ablate.data.datasets import dataset_root

    steps, warmup = (6, 2) if s.quick else (s.e2e_steps, s.e2e_warmup)
    workers = _workers(s)
    cfg = compose_run(e2e_overrides(s, workers, False))
    data_dir = dataset_root(cfg.data)  # draws the built-in set once, before any timing
    plan: list[tuple[str, str, Any, dict[str, str] | None]] = []  # name, side, overrides or command, env
    variants = [("", workers, None)]
    if not s.quick:
        variants += [("/workers=0", 0, None)]
        if s.device.type == "cpu":
            variants += [("/threads=1", workers, {"OMP_NUM_THREADS": "1"})]
    for suffix, w, env in variants:
        plan.append((f"ours{suffix}", "ours", e2e_overrides(s, w, False), env))
        if s.timm_train is not None:
            command = timm_ref.timm_command(s.timm_train, e2e_overrides(s, w, False), data_dir,
                                            Path("timm-out"), w, s.device_name)
            plan.append((f"timm{suffix}", "timm", command, env))
    if not s.quick:
        plan.append(("ours+repeated_aug", "ours", e2e_overrides(s, workers, True), None))
        if workers > 0:  # loader workers at the training process's own priority (data/loader.py)
            nice_off = [*e2e_overrides(s, workers, False), "runtime.worker_nice=0"]
            plan.append(("ours/worker_nice=0", "ours", nice_off, None))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in plan}
    for repeat in range(1 if s.quick else s.repeats):
        for name, side, spec, env in plan:
            start = time.perf_counter()
            if side == "ours":
                result = runs.run_ours(spec, steps, cfg.train.global_batch, s.cache, warmup, extra_env=env)
            else:
                result = runs.run_timm(spec, steps, cfg.train.global_batch, s.cache, warmup, extra_env=env)
            results[name].append(result)
            _log(f"[bench] e2e {name} repeat {repeat}: {result['images_per_s']:.0f} images/s steady, "
                 f"data wait {result['data_wait_fraction']:.0%}, {time.perf_counter() - start:.0f}s")
    for name, rows in results.items():
        settings = {"steps": steps, "warmup_steps_excluded": warmup, "batch": cfg.train.global_batch,
                    "model": f"{cfg.model.name} {dict(cfg.model.kwargs)}", "train_size": cfg.resolution.train_size,
                    "data": str(data_dir), "workers": 0 if name.endswith("/workers=0") else workers,
                    "torch_threads": 1 if name.endswith("/threads=1") else "default (cores)",
                    "repeated_aug": "3 (ours only)" if name == "ours+repeated_aug" else "off on both sides",
                    "worker_nice": "0" if name.endswith("worker_nice=0") else "ours 19 (default), timm 0"}
        runs.add_run_figures(report, name, rows, settings)
    for suffix, _, _ in variants:
        report.compare("e2e_train", f"ours{suffix}", f"timm{suffix}", target=1.0)
        report.compare("e2e_incl_startup", f"ours{suffix}", f"timm{suffix}")
        report.compare("train_step_in_run", f"ours{suffix}", f"timm{suffix}", target=1.0)
    report.compare("e2e_train", "ours", "ours/worker_nice=0")
    report.compare("e2e_train", "ours/threads=1", "ours")
    report.compare("e2e_train", "ours/threads=1", "timm")


def section_e2e_run(s: Settings, report: Report) -> None:
    """Whole runs of --e2e-epochs epochs, ours and timm's train.py in turn, timed from start to exit: the demo
    (issue #23: demo model, batch 128, built-in data), or --run-model at --run-size on --run-data / --draw-jpegs
    JPEGs (repeated augmentation off on both sides, --workers loader workers, --repeats pairs)."""
    from deit_ablate.bench import whole_run

    workers = _workers(s)
    if s.jpeg_run is not None:
        overrides = whole_run.image_folder_overrides(s.jpeg_run, workers, s.device_name, s.cache, _log)
    else:
        overrides = e2e_overrides(s, workers, False)
    whole_run.measure(report, overrides, 1 if s.quick else s.e2e_epochs, s.timm_train, workers, s.device_name,
                      s.cache, 1 if s.quick else s.repeats, _log)


def section_startup(s: Settings, report: Report) -> None:
    """`python train.py --cfg job`, and composing the 26-run Table 8 sweep with Hydra's compose API."""
    import sys

    from deit_ablate.bench import runs

    repeats = 1 if s.quick else s.repeats
    cfg_job = [sys.executable, str(TRAIN_PY), "--cfg", "job"]
    sweep = runs.compose_sweep_command()
    job_s, sweep_s = [], []
    for _ in range(repeats):
        job_s.append(runs.time_command(cfg_job, s.cache))
        sweep_s.append(runs.time_command(sweep, s.cache))
    report.add(Figure("startup_cfg_job", "ours", median(job_s), "s", report.device["summary"],
                      "python train.py --cfg job", {}, job_s, {"target": "< 3 s", "meets": median(job_s) < 3}))
    report.add(Figure("compose_sweep_26", "ours", median(sweep_s), "s", report.device["summary"],
                      "python -c '<deit_ablate.bench.runs.COMPOSE_SWEEP>'",
                      {"runs": 26, "what": "fresh interpreter: imports + 26 hydra.compose calls (ablation=* x "
                       "stage=pretrain,finetune)"}, sweep_s, {"target": "< 10 s", "meets": median(sweep_s) < 10}))
