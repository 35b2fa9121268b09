#!/usr/bin/env python
"""Throughput benchmark of deit_ablate on whatever device it runs, side by side with timm's train.py.

    python scripts/bench.py --quick --skip-timm               # smoke run, ours only (30-60 s)
    python scripts/bench.py --timm-train /tmp/timm_train.py   # full: all sections, ours vs timm (15-35 min, 2 CPUs)
    python scripts/bench.py --sections step --compile         # one section (here with torch.compile)
    python scripts/bench.py --sections e2e_run --timm-train /tmp/timm_train.py --draw-jpegs 6400 \
        --run-model deit_small --run-size 224 --run-batch 256 --e2e-epochs 3 --repeats 2   # whole runs on JPEGs

Sections: matmul (dense matmul FLOP/s, the MFU reference: bf16 on GPU, fp32 on CPU), step (Trainer.train_step on
synthetic on-device batches; images/s, FLOPs/image, MFU; AdamW implementations; --compile), host_step (the
host's ms per step at batch 256 at 224 px on a stand-in network, ours against timm's loop, and the loader per worker
core, ours against timm's create_transform; docs/host-step.md), pipeline (our DeiT
train transform + DataLoader on 500x375 JPEGs at 224 px, default vs data.fast_jpeg vs timm's loader), workers
(per-epoch worker startup, persistent workers on/off), e2e (short real runs of train.py and of timm's train.py,
alternately: steady images/s, data-wait fraction, compute-only step rate), e2e_run (whole runs of --e2e-epochs
epochs, ours and timm's train.py in turn, each process timed from start to exit: the demo on built-in data, or with
--run-data / --draw-jpegs a model at a size on JPEGs), startup (`train.py --cfg job`,
composing the 26-run sweep). On a GPU the step section defaults to DeiT-B/16 at 224 in bf16, batch 128.

timm's train.py is not in the timm wheel; see deit_ablate/bench/timm_ref.py for how to get it. Results go to
--out (JSON, every figure with device, command and settings) and a table on stdout.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from deit_ablate.bench import suite
from deit_ablate.bench.compose import CONF
from deit_ablate.bench.env import describe
from deit_ablate.bench.pipeline import SHAPES, cache_root
from deit_ablate.bench.report import Report
from deit_ablate.bench.whole_run import JpegRun
from deit_ablate.core.distributed import choose_device
from deit_ablate.record.runfiles import folder_problem
from deit_ablate.run.commands import command, number_option

DEVICES = ("auto", "cpu", "cuda")


def refuse(message: str) -> NoReturn:
    """Bad input: one line naming the problem and the fix, exit status 2, before anything is measured or written."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (the fix: --help), exit status 2."""

    def error(self, message: str) -> NoReturn:
        refuse(f"{message}. python scripts/bench.py --help lists the options and their ranges.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    count, positive = number_option(int, 0), number_option(int, 1)
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test, not a figure")
    parser.add_argument("--out", default="bench.json", help="JSON results file (default: bench.json)")
    parser.add_argument("--sections", default=",".join(suite.SECTIONS), help=f"subset of {','.join(suite.SECTIONS)}")
    parser.add_argument("--timm-train", type=Path, help="path to timm's train.py (see deit_ablate/bench/timm_ref.py)")
    parser.add_argument("--skip-timm", action="store_true", help="measure our side only")
    parser.add_argument("--device", default="auto", choices=DEVICES, help="auto (GPU if any), cpu or cuda")
    parser.add_argument("--repeats", type=positive, default=3, help="alternating repeats per measurement (median kept)")
    parser.add_argument("--model", help="model group option for the step section (default: vit_demo on CPU, "
                                        "deit_base on GPU)")
    parser.add_argument("--size", type=positive, help="train size for the step section (default: 32 CPU, 224 GPU)")
    parser.add_argument("--batch", type=positive, default=128, help="per-device batch of the step section")
    parser.add_argument("--compile", action="store_true", help="also measure the step with torch.compile")
    parser.add_argument("--jpegs", type=positive, default=1024, help="JPEGs in the pipeline set")
    parser.add_argument("--e2e-steps", type=positive, default=30, help="optimizer steps per end-to-end run")
    parser.add_argument("--e2e-epochs", type=positive, default=4,
                        help="epochs of each whole run in e2e_run (default 4)")
    parser.add_argument("--e2e-micro-batch", type=positive,
                        help="our side's train.micro_batch in e2e and e2e_run (default: the demo's 32, 4 micro-batches "
                             "a step; 128: one per step, the computation timm's makes)")
    parser.add_argument("--workers", type=count, help="loader workers (default: a run's on this device: the cores of "
                                                     "this process on a CPU, all but two on a GPU)")
    jpegs = parser.add_argument_group(
        "e2e_run on JPEGs", "Whole runs of a model at a size on ImageNet-sized JPEGs, as a GPU user runs them, instead "
        "of the demo on built-in data (the default): ours is `python train.py preset=paper model=M data=imagefolder "
        "data.root=DIR resolution.train_size=S resolution.eval_size=S train.global_batch=B train.micro_batch=B "
        "augment.repeated_aug=1 runtime.num_workers=W ...` (eval: resize S / 0.875, centre crop), timm's the same "
        "flags. Give --run-data or --draw-jpegs; the other flags have defaults.")
    jpegs.add_argument("--run-data", type=Path, metavar="DIR", help="an ImageFolder tree of JPEGs: DIR/train/<class>/ "
                       "and DIR/val/<class>/")
    jpegs.add_argument("--draw-jpegs", type=positive, metavar="N",
                       help="draw N training JPEGs (and N/8 validation ones) of 500x375 at quality 90 once into the "
                            "cache, and train on them")
    jpegs.add_argument("--draw-classes", type=positive, default=10, metavar="K",
                       help=f"classes of the drawn set (1-{len(SHAPES)}; default 10)")
    jpegs.add_argument("--run-model", metavar="M", help="model group option (conf/model/; default deit_small)")
    jpegs.add_argument("--run-model-kwargs", default="", metavar="K=V,...", help="change the model, e.g. "
                       "embed_dim=64,depth=2,num_heads=2 (timm model kwargs, both sides)")
    jpegs.add_argument("--run-size", type=positive, metavar="S", help="train and eval size in pixels (default 224)")
    jpegs.add_argument("--run-batch", type=positive, metavar="B", help="global batch, one micro-batch a step (default "
                       "128; 32 with --quick)")
    return parser.parse_args(argv)


def _model_kwargs(text: str) -> dict[str, str]:
    """`embed_dim=64,depth=2` as a dict; exits naming the bad item."""
    kwargs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier() or not value:
            refuse(f"--run-model-kwargs: '{item}' is not NAME=VALUE. Give comma-separated timm model arguments, "
                     "e.g. --run-model-kwargs embed_dim=64,depth=2,num_heads=2.")
        kwargs[key] = value
    return kwargs


def _check_image_folder(root: Path) -> Path:
    """`root` if it holds train/ and val/ with class folders; exits saying what is missing."""
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir() or not any(entry.is_dir() for entry in folder.iterdir()):
            refuse(f"--run-data {root}: {folder} is missing or holds no class folder. Point --run-data at an "
                     "ImageFolder tree (DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg), or draw one with "
                     "--draw-jpegs N.")
    return root.resolve()


def jpeg_run_settings(args: argparse.Namespace, sections: list[str]) -> JpegRun | None:
    """e2e_run's run on JPEGs from the command line (None: the demo); exits on bad input."""
    given = [flag for flag, value in (("--run-data", args.run_data), ("--draw-jpegs", args.draw_jpegs),
                                      ("--run-model", args.run_model), ("--run-size", args.run_size),
                                      ("--run-batch", args.run_batch), ("--run-model-kwargs", args.run_model_kwargs))
             if value]
    if not given:
        return None
    if "e2e_run" not in sections:
        refuse(f"{', '.join(given)} configure the e2e_run section, which --sections leaves out; add e2e_run to "
                 "--sections.")
    if (args.run_data is None) == (args.draw_jpegs is None):
        refuse(f"{', '.join(given)}: e2e_run on JPEGs needs exactly one image set: --run-data DIR (an ImageFolder "
                 "with train/ and val/) or --draw-jpegs N (drawn into the cache).")
    model = args.run_model or "deit_small"
    if not (CONF / "model" / f"{model}.yaml").is_file():
        options = ", ".join(sorted(path.stem for path in (CONF / "model").glob("*.yaml")))
        refuse(f"--run-model {model}: no such model group option. Choose one of {options}.")
    run = JpegRun(model=model, model_kwargs=_model_kwargs(args.run_model_kwargs), size=args.run_size or 224,
                  batch=args.run_batch or (32 if args.quick else 128))
    for flag, value in (("--run-size", run.size), ("--run-batch", run.batch)):
        if value < 1:
            refuse(f"{flag} {value}: give a positive number.")
    if args.run_data is not None:
        return replace(run, data=_check_image_folder(args.run_data))
    if not 1 <= args.draw_classes <= len(SHAPES):
        refuse(f"--draw-classes {args.draw_classes}: a drawn set has 1 to {len(SHAPES)} classes.")
    if args.draw_jpegs < run.batch:
        refuse(f"--draw-jpegs {args.draw_jpegs} is fewer than one batch of {run.batch}: an epoch would hold no step. "
                 "Draw more images or lower --run-batch.")
    return replace(run, draw=args.draw_jpegs, classes=args.draw_classes)


def chosen_sections(args: argparse.Namespace) -> list[str]:
    """The sections to run, in the suite's order of --sections; exits naming an unknown one."""
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(sections) - set(suite.SECTIONS))
    if unknown:
        refuse(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(suite.SECTIONS)}")
    if "step" in sections and "matmul" not in sections:
        sections.insert(0, "matmul")  # MFU needs the matmul rate
    return sections


def gpu_available() -> bool:
    """Whether torch can use a CUDA device here."""
    import torch

    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except RuntimeError:  # a driver that fails to start
        return False


def check_out(out: Path) -> None:
    """The JSON report can be written at `out`; else one line (a folder there, a folder that cannot be written)."""
    if out.is_dir():
        refuse(f"--out {out} is a folder: give the JSON file to write, e.g. --out {out / 'bench.json'}.")
    folder = out.resolve().parent
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        refuse(f"--out {out}: its folder {folder} {what}. Give --out a path in an existing folder.")
    problem = folder_problem(folder)
    if problem is None:
        try:  # what the permission bits do not say (root on a read-only or pseudo file system): a nameless probe
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            problem = f"{folder} is not writable ({error.strerror or error})"
    if problem is not None:
        refuse(f"--out {out} cannot be written: {problem}. Give --out a path in a folder this user can write.")


def settings_from(args: argparse.Namespace, argv: list[str]) -> suite.Settings:
    """Settings for this invocation; model and size follow the device unless given."""
    jpeg_run = jpeg_run_settings(args, chosen_sections(args))
    check_out(Path(args.out))
    if args.device == "cuda" and not gpu_available():
        refuse("--device cuda: no GPU is usable here (torch sees no CUDA device). Run on a machine with one, or give "
               "--device cpu (or auto: the GPU when there is one).")
    device = choose_device(args.device, local_rank=0)
    gpu = device.type == "cuda"
    if args.timm_train is not None and not args.timm_train.is_file():
        refuse(f"--timm-train {args.timm_train}: no such file. See deit_ablate/bench/timm_ref.py to get it.")
    if args.timm_train is None and not args.skip_timm and not args.quick:
        refuse("the side-by-side sections need timm's train.py: pass --timm-train PATH (see "
                 "deit_ablate/bench/timm_ref.py), or --skip-timm for our side only.")
    quick = args.quick
    return suite.Settings(
        device=device, cache=cache_root(), command="python scripts/bench.py " + " ".join(shlex.quote(a) for a in argv),
        quick=quick, repeats=args.repeats, timm_train=None if args.skip_timm else args.timm_train,
        model=args.model or ("deit_base" if gpu else "vit_demo"), size=args.size or (224 if gpu else 32),
        batch=32 if quick and args.batch == 128 else args.batch, compile=args.compile, jpeg_count=args.jpegs,
        e2e_steps=args.e2e_steps, e2e_batch=32 if quick else 128, e2e_epochs=args.e2e_epochs,
        e2e_micro_batch=args.e2e_micro_batch, workers=args.workers, jpeg_run=jpeg_run)


@command("scripts/bench.py")
def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, print the table, write the JSON."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    settings = settings_from(args, argv)
    report = Report(describe(settings.device), settings.command)
    sections = chosen_sections(args)
    start = time.perf_counter()
    for name in suite.SECTIONS:
        if name in sections:
            print(f"[bench] section {name} ...", flush=True)
            getattr(suite, f"section_{name}")(settings, report)
            report.write(args.out)  # keep what is measured so far
    report.device["bench_seconds"] = round(time.perf_counter() - start, 1)
    report.write(args.out)
    print()
    print(report.table())
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
