"""One prepared GPU check (scripts/gpu_check.sh): the figures a GPU session reports, in one JSON and one table.

    python -m deit_ablate.bench.gpu_check OUT.json          # on a CUDA GPU, < 8 minutes on one H200
    python -m deit_ablate.bench.gpu_check OUT.json --dry    # the same flow on the CPU, 224 px, a narrow DeiT

bf16 matmul rate; DeiT-B/16 bf16 train step (Trainer.train_step on synthetic uint8 batches as the loader yields them,
through the trainer's per-batch transform), eager and torch.compile,
images/s and MFU; host syncs per step; the released code's precision (train.amp=fp16: fp16 autocast + loss scaler),
images/s, the steps the scaler skipped and its final scale; input pipeline images/s at 224 (pil: DataLoader on all
cores, dali: the DALI pipeline on the GPU) on JPEGs it draws; the hard-token distillation step (RegNetY-16GF
teacher, random init, + DeiT-B distilled); peak GPU memory. Nothing is installed or downloaded. Without a GPU it
stops at once. --dry runs every function of the check on the CPU at 224 px with a narrow DeiT (patch 16, one block of
width 48) on the same uint8 batches, the CUDA calls replaced by bench.env's CPU equivalents, and compiles with the
aot_eager backend (torch.compile's graph capture without inductor's C++ code generation, two minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deit_ablate.bench.env import DeviceCalls
from deit_ablate.core.atomic import write_text_atomic
from deit_ablate.run.commands import command as entry_point

# The targets for one H200 (docs/PERFORMANCE.md): train step and the DALI pipeline, images/s.
TARGETS = {"train_step_eager_images_per_s": 3000.0, "pipeline_dali_images_per_s": 4000.0}
NO_GPU_EXIT = 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line: the JSON path, and --dry for the CPU toy run."""
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where to write the JSON results")
    parser.add_argument("--dry", action="store_true",
                        help="CPU, 224 px, a narrow DeiT: runs every function of the check and writes the JSON")
    parser.add_argument("--jpegs", type=int, default=None, help="JPEGs drawn for the pipeline (default 512; dry 16)")
    return parser.parse_args(argv)


# --dry's student: DeiT-Tiny's layout (patch 16 at 224 px, 196 tokens) cut to one block of width 48, quick on a CPU
NARROW_DEIT = ["model.kwargs.patch_size=16", "model.kwargs.embed_dim=48", "model.kwargs.depth=1",
               "model.kwargs.num_heads=3"]


def _sizes(dry: bool) -> dict[str, Any]:
    if dry:
        return {"model": "vit_demo", "model_overrides": NARROW_DEIT, "compile_backend": "aot_eager",
                "teacher": "cnn_demo", "size": 224, "batch": 8, "steps": 2, "warmup": 1, "repeats": 1, "jpegs": 16,
                "pipeline_batch": 8, "pipeline_size": 224, "matmul_n": 256}
    return {"model": "deit_base", "model_overrides": [], "compile_backend": "inductor", "teacher": "regnety_160",
            "size": 224, "batch": 128, "steps": 20, "warmup": 5, "repeats": 3, "jpegs": 512, "pipeline_batch": 128,
            "pipeline_size": 224, "matmul_n": 8192}


def _log(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


def _step_overrides(sizes: dict[str, Any], data_root: str, device: str, model: str, amp: str = "bf16") -> list[str]:
    return [f"model={model}", *sizes["model_overrides"], f"resolution.train_size={sizes['size']}",
            f"resolution.eval_size={sizes['size']}",
            f"train.global_batch={sizes['batch']}", f"train.micro_batch={sizes['batch']}",
            f"runtime.max_batch_per_device={sizes['batch']}",
            "runtime.num_workers=0", f"data.root={data_root}", "data.builtin.train_per_class=30",
            "data.builtin.val_per_class=10", f"runtime.device={device}", f"train.amp={amp}"]


def _peak_memory_gib(calls: DeviceCalls) -> float | None:
    peak = calls.peak_memory_bytes()
    return None if peak is None else peak / 2**30


def measure_train_steps(sizes: dict[str, Any], device: torch.device, data_root: str, peak: float,
                        results: dict[str, Any], calls: DeviceCalls) -> None:
    """DeiT-B/16 bf16 train step, eager and compiled: images/s, MFU against the measured matmul rate, syncs."""
    from deit_ablate.bench import step
    from deit_ablate.bench.compose import compose_run
    from deit_ablate.bench.report import median

    overrides = _step_overrides(sizes, data_root, device.type, sizes["model"])
    cfg = compose_run(overrides)
    for name, compile_model in (("eager", False), ("compile", True)):
        calls.reset_peak_memory()
        start = time.perf_counter()
        setup = step.build_trainer(overrides, device, compile_model=compile_model, calls=calls,
                                   compile_backend=sizes["compile_backend"])
        if compile_model:
            step.run_steps(setup, 1)
        rates = step.alternate({name: setup}, sizes["steps"], sizes["repeats"], sizes["warmup"])[name]
        flops = step.train_flops_per_image(setup.trainer.model, sizes["size"], device)
        value = median(rates)
        results[f"train_step_{name}"] = {
            "images_per_s": value, "samples": rates, "train_gflops_per_image": flops / 1e9,
            "mfu": flops * value / peak, "compiled": setup.compiled, "model": cfg.model.name,
            "compile_backend": sizes["compile_backend"] if compile_model else None,
            "batch": sizes["batch"], "size": sizes["size"], "amp": "bf16",
            "peak_memory_gib": _peak_memory_gib(calls), "seconds": time.perf_counter() - start}
        if name == "eager":
            results["host_syncs_per_step"] = step.count_syncs_per_step(setup)
        _log(f"train step {name}: {value:.0f} images/s, MFU {flops * value / peak:.1%}")
        del setup
        calls.empty_cache()


def measure_fp16(sizes: dict[str, Any], device: torch.device, data_root: str, results: dict[str, Any],
                 calls: DeviceCalls) -> None:
    """DeiT-B/16 train steps under train.amp=fp16, the released code's precision: images/s, the steps the loss
    scaler skipped (inf/NaN gradients) and its scale at the end, and the loss before and after."""
    from deit_ablate.bench import step
    from deit_ablate.bench.compose import compose_run
    from deit_ablate.bench.report import median

    overrides = _step_overrides(sizes, data_root, device.type, sizes["model"], amp="fp16")
    cfg = compose_run(overrides)
    calls.reset_peak_memory()
    start = time.perf_counter()
    setup = step.build_trainer(overrides, device, calls=calls)
    trainer = setup.trainer
    loss_first = trainer.train_step(setup.images(), setup.targets).item()
    rates = step.alternate({"fp16": setup}, sizes["steps"], sizes["repeats"], sizes["warmup"])["fp16"]
    loss_last = trainer.train_step(setup.images(), setup.targets).item()
    results["train_step_fp16"] = {
        "images_per_s": median(rates), "samples": rates, "amp": "fp16", "model": cfg.model.name,
        "batch": sizes["batch"], "size": sizes["size"], "steps": trainer.step,
        "amp_skipped_steps": trainer.amp_skipped_steps, "loss_scale": trainer.scaler.get_scale(),
        "loss_first": loss_first, "loss_last": loss_last, "peak_memory_gib": _peak_memory_gib(calls),
        "seconds": time.perf_counter() - start}
    _log(f"train step fp16: {median(rates):.0f} images/s, {trainer.amp_skipped_steps} of {trainer.step} steps "
         f"skipped, loss scale {trainer.scaler.get_scale():.0f}")
    del setup, trainer
    calls.empty_cache()


def measure_distillation(sizes: dict[str, Any], device: torch.device, data_root: str, workdir: Path,
                         results: dict[str, Any], calls: DeviceCalls) -> None:
    """The hard-token distillation step: a randomly initialized teacher (written here, no download) and the
    student with a distillation token, as distill=hard_token trains them."""
    import timm

    from deit_ablate.bench import step
    from deit_ablate.bench.compose import compose_run
    from deit_ablate.bench.report import median

    teacher_cfg = compose_run([f"model={sizes['teacher']}"])
    teacher = timm.create_model(teacher_cfg.model.name, num_classes=10, **dict(teacher_cfg.model.kwargs))
    checkpoint = workdir / "teacher.pt"
    torch.save(teacher.state_dict(), checkpoint)
    del teacher
    overrides = _step_overrides(sizes, data_root, device.type, sizes["model"])
    overrides += ["distill=hard_token", f"distill.teacher.model={teacher_cfg.model.name}",
                  f"distill.teacher.checkpoint={checkpoint}"]
    if teacher_cfg.model.kwargs:
        overrides += [f"+distill.teacher.kwargs.{k}={v}" for k, v in teacher_cfg.model.kwargs.items()]
    cfg = compose_run(overrides)
    calls.reset_peak_memory()
    start = time.perf_counter()
    setup = step.build_trainer(overrides, device, calls=calls)
    rates = step.alternate({"distill": setup}, sizes["steps"], sizes["repeats"], sizes["warmup"])["distill"]
    results["distill_hard_token_step"] = {
        "images_per_s": median(rates), "samples": rates, "student": type(setup.trainer.module).__name__,
        "student_model": cfg.model.distilled_name, "teacher": cfg.distill.teacher.model, "batch": sizes["batch"],
        "size": sizes["size"], "peak_memory_gib": _peak_memory_gib(calls), "seconds": time.perf_counter() - start}
    _log(f"distillation step: {median(rates):.0f} images/s")
    del setup
    calls.empty_cache()


def measure_pipelines(sizes: dict[str, Any], device: torch.device, data_root: str, jpegs: int, workdir: Path,
                      results: dict[str, Any]) -> None:
    """Input pipeline at 224 on drawn 500x375 JPEGs: pil (DataLoader on every core) and dali (on the device)."""
    from deit_ablate.bench import pipeline
    from deit_ablate.bench.report import median
    from deit_ablate.data.dali import dali_available
    from deit_ablate.data.loader import default_num_workers

    start = time.perf_counter()
    root = pipeline.ensure_jpeg_set(jpegs, root=workdir / "jpegs")
    _log(f"drew {jpegs} JPEGs in {time.perf_counter() - start:.0f}s")
    workers = default_num_workers()
    size = sizes["pipeline_size"]
    base = [f"resolution.train_size={size}", f"runtime.num_workers={workers}", f"data.root={data_root}"]
    backends = {"pil": ["data.backend=pil"]}
    if dali_available():
        backends["dali"] = ["data.backend=dali"]
    else:
        results["pipeline_dali"] = {"error": "DALI is not importable here (bash scripts/install.sh installs it)"}
    for name, extra in backends.items():
        setup = pipeline.loader_setup([*base, *extra])
        dataset, batch_step = pipeline.jpeg_dataset(root, setup)
        loader = pipeline.our_loader(setup, dataset, sizes["pipeline_batch"], batch_step, device)
        rows = [pipeline.epoch_rate(loader) for _ in range(1 + sizes["repeats"])][1:]  # the first: warm-up
        rates = [row["images_per_s"] for row in rows]
        results[f"pipeline_{name}"] = {
            "images_per_s": median(rates), "samples": rates, "workers_or_threads": workers, "train_size": size,
            "batch": sizes["pipeline_batch"], "jpegs": jpegs, "repeated_aug": setup.spec.augment.repeated_aug,
            "where": pipeline_where(name, device)}
        _log(f"pipeline {name}: {median(rates):.0f} images/s")


def pipeline_where(backend: str, device: torch.device) -> str:
    """Where a pipeline backend's work runs on `device`, for the JSON."""
    if backend != "dali":
        return "DataLoader workers, BatchNormalize on the device"
    return "DALI on the GPU (mixed decoder)" if device.type == "cuda" else "DALI on the CPU"


def peak_memory(results: dict[str, Any]) -> float | None:
    """The highest peak_memory_gib of the figures (None where the device does not track it)."""
    peaks = [v["peak_memory_gib"] for v in results.values() if isinstance(v, dict) and v.get("peak_memory_gib")
             is not None]
    return max(peaks, default=None)


def table(report: dict[str, Any]) -> str:
    """The printed summary: one line per figure, with the issue's targets where it sets one."""
    r = report["results"]
    lines = [f"GPU check on {report['device'].get('summary')}  ({report['seconds']:.0f}s)"]

    def add(label: str, value: Any, unit: str = "", target: float | None = None) -> None:
        shown = f"{value:,.1f} {unit}" if isinstance(value, (int, float)) else str(value)
        mark = "" if target is None or not isinstance(value, (int, float)) else (
            f"   target >= {target:,.0f}: {'met' if value >= target else 'NOT met'}")
        lines.append(f"  {label:<44} {shown}{mark}")

    add(f"matmul {r.get('matmul_dtype')}", r["matmul_bf16_tflops"], "TFLOP/s")
    for name in ("eager", "compile"):
        step = r.get(f"train_step_{name}", {})
        add(f"train step {name} ({step.get('model')})", step.get("images_per_s"), "images/s",
            TARGETS["train_step_eager_images_per_s"] if name == "eager" else None)
        add(f"  MFU {name}", 100 * step["mfu"] if "mfu" in step else None, "%")
    add("host syncs per step", r.get("host_syncs_per_step"))
    fp16 = r.get("train_step_fp16", {})
    add("train step fp16 (loss scaler)", fp16.get("images_per_s"), "images/s")
    if "amp_skipped_steps" in fp16:
        add("  fp16 skipped steps / final loss scale", f"{fp16['amp_skipped_steps']} of {fp16['steps']} / "
            f"{fp16['loss_scale']:,.0f}")
    add("pipeline pil (all cores)", r.get("pipeline_pil", {}).get("images_per_s"), "images/s")
    add("pipeline dali", r.get("pipeline_dali", {}).get("images_per_s", r.get("pipeline_dali", {}).get("error")),
        "images/s", TARGETS["pipeline_dali_images_per_s"])
    add("distillation step (hard token)", r.get("distill_hard_token_step", {}).get("images_per_s"), "images/s")
    add("peak GPU memory", r.get("peak_memory_gib"), "GiB")
    return "\n".join(lines)


@entry_point("scripts/gpu_check.sh")
def main(argv: list[str] | None = None) -> int:
    """Check for a GPU, run every measurement, write the JSON, print the table."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a machine with "
              "a GPU, or add --dry for the CPU schema check.", file=sys.stderr, flush=True)
        return NO_GPU_EXIT
    from deit_ablate.bench.env import describe, device_calls, matmul_rate

    device = torch.device("cuda", 0) if not args.dry else torch.device("cpu")
    calls = device_calls(device)
    sizes = _sizes(args.dry)
    jpegs = args.jpegs or sizes["jpegs"]
    command = "bash scripts/gpu_check.sh " + " ".join(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    report: dict[str, Any] = {"command": command, "device": describe(device, calls), "dry": args.dry,
                              "targets": TARGETS,
                              "results": {}}
    results = report["results"]
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        workdir = Path(tmp)
        data_root = os.environ.get("DEIT_ABLATE_CACHE", str(workdir)) + "/builtin"
        rate = matmul_rate(device, n=sizes["matmul_n"])
        results["matmul_bf16_tflops"] = rate["flops_per_s"] / 1e12
        results["matmul_dtype"] = rate["dtype"]
        _log(f"matmul {rate['dtype']}: {rate['flops_per_s'] / 1e12:.1f} TFLOP/s")
        measure_train_steps(sizes, device, data_root, rate["flops_per_s"], results, calls)
        measure_fp16(sizes, device, data_root, results, calls)
        measure_distillation(sizes, device, data_root, workdir, results, calls)
        measure_pipelines(sizes, device, data_root, jpegs, workdir, results)
    results["peak_memory_gib"] = peak_memory(results)
    report["seconds"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(report, indent=2, default=str))
    print(table(report), flush=True)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
