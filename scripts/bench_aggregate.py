#!/usr/bin/env python
"""Time the aggregator on N offline runs (default 1,000).

How the runs are made: one template run is written for real with wandb (offline, in a subprocess, with
`--steps` training log rows and `--epochs` evaluation rows, no status yet). Each of the N runs is a clone
of its `run-*.wandb` log: the template's run id is replaced by a new id of the same length inside every
record (protobuf strings are length-prefixed, so an equal-length swap keeps them valid), the run record
gets the clone's config (ablation, stage, seed, run_id, tags), a summary record with the clone's status and
top-1 is inserted before the exit record, and the records are framed again (fresh CRCs) with
`deit_ablate.analysis.aggregate.wandb_log.encode_log`. Only the log file is written (no files/, logs/ folders).
About 3% of the clones diverge, 2% are unfinished, and 5% get a second, unfinished copy under the same
id (a requeue), so de-duplication is exercised too. `--real` writes all N runs with wandb instead.

    python scripts/bench_aggregate.py                 # 1,000 cloned runs, timed in-process, as a CLI, with --curves
    python scripts/bench_aggregate.py -n 200 --real   # 200 runs written by wandb itself
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deit_ablate.analysis.aggregate import cli  # noqa: E402
from deit_ablate.analysis.aggregate.paper import paper_table  # noqa: E402
from deit_ablate.analysis.aggregate.wandb_log import encode_log, read_log  # noqa: E402
from deit_ablate.record.rundir import wandb_root  # noqa: E402
from deit_ablate.run.commands import command  # noqa: E402

TEMPLATE_ID = "tmpl00000000"  # clones use ids of the same length: b00000000001, ...
WRITER = r"""
import json, os, sys
os.environ["WANDB_SILENT"] = "true"
import wandb
spec = json.load(open(sys.argv[1]))
settings = wandb.Settings(x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
                          console="off", save_code=False, disable_git=True, x_save_requirements=False)
for r in spec["runs"]:
    run = wandb.init(project="deit-ablate-bench", dir=spec["dir"], mode="offline", id=r["id"], name=r["id"],
                     group="bench", tags=r["tags"], config=r["config"], resume="allow", settings=settings)
    per_epoch = max(1, spec["steps"] // max(1, spec["epochs"]))
    for step in range(spec["steps"]):
        run.log({"train/loss": 2.0 / (1 + step), "train/lr": 1e-3, "train/img_per_s": 1000.0})
        if (step + 1) % per_epoch == 0:
            run.log({"epoch": step // per_epoch, "val/top1": 50.0, "val/top5": 80.0, "val/loss": 1.5})
    run.summary.update(r["summary"])
    run.finish()
"""


def plan(n: int, seed: int = 0) -> list[dict]:
    """N run descriptions over the 13 rows and 2 stages, with some diverged, unfinished and requeued."""
    rng = random.Random(seed)
    rows = [r.key for r in paper_table("table8").rows]
    runs, i = [], 0
    while len(runs) < n:
        ablation, stage = rows[i % len(rows)], ("pretrain", "finetune")[(i // len(rows)) % 2]
        rid = f"b{i + 1:011d}"
        draw = rng.random()
        status = "diverged" if draw < 0.03 else ("unfinished" if draw < 0.05 else "finished")
        summary = {"status": status, "top1": round(rng.gauss(70.0, 2.0), 3)} if status != "unfinished" else {}
        config = {
            "ablation": ablation,
            "stage": stage,
            "seed": i // (2 * len(rows)),
            "preset": "demo",
            "run_id": rid,
            "model": {"name": "vit_demo"},
            "data": {"name": "builtin"},
            "distill": {"type": "none"},
            "resolution": {"train_size": 32 if stage == "pretrain" else 48},
        }
        runs.append({"id": rid, "config": config, "summary": summary, "tags": [ablation, stage, "demo"]})
        if draw > 0.95 and len(runs) < n:  # requeued: an earlier, unfinished copy under the same id
            runs.append({**runs[-1], "summary": {}})
        i += 1
    return runs


def write_real(spec: list[dict], out: Path, steps: int, epochs: int) -> None:
    """Write runs with wandb itself, in a subprocess."""
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps({"dir": str(out), "steps": steps, "epochs": epochs, "runs": spec}))
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    subprocess.run([sys.executable, "-c", WRITER, str(spec_file)], check=True, env=env)


def clone(spec: list[dict], out: Path, steps: int, epochs: int) -> Path:
    """Write one real template run, then N clones of its log with new ids, configs and summaries."""
    from wandb.proto.wandb_internal_pb2 import Record

    template_dir = out / "template"
    write_real(
        [{"id": TEMPLATE_ID, "config": spec[0]["config"], "summary": {}, "tags": []}], template_dir, steps, epochs
    )
    log = next(wandb_root(template_dir).glob(f"*/run-{TEMPLATE_ID}.wandb"))
    records = read_log(log).records
    kinds = []
    for payload in records:
        rec = Record()
        rec.ParseFromString(payload)
        kinds.append(rec.WhichOneof("record_type"))
    run_at, exit_at = kinds.index("run"), kinds.index("exit")
    template_run = Record()
    template_run.ParseFromString(records[run_at])
    wandb_dir = wandb_root(out)
    wandb_dir.mkdir(parents=True, exist_ok=True)
    old = TEMPLATE_ID.encode()
    seen: dict[str, int] = {}
    for r in spec:
        new = r["id"].encode()
        run = Record()
        run.CopyFrom(template_run)
        run.run.run_id = r["id"]
        run.run.display_name = r["id"]
        run.run.tags[:] = r["tags"]
        del run.run.config.update[:]
        for key, value in r["config"].items():
            item = run.run.config.update.add()
            item.key, item.value_json = key, json.dumps(value)
        summary = Record()
        summary.CopyFrom(template_run)
        summary.ClearField("run")
        for key, value in r["summary"].items():
            item = summary.summary.update.add()
            item.key, item.value_json = key, json.dumps(value)
        body = [p.replace(old, new) for p in records]
        body[run_at] = run.SerializeToString().replace(old, new)
        if r["summary"]:
            body.insert(exit_at, summary.SerializeToString().replace(old, new))
        copies = seen[r["id"]] = seen.get(r["id"], -1) + 1
        folder = wandb_dir / f"offline-run-20250101_000000-{r['id']}{f'-{copies}' if copies else ''}"
        folder.mkdir()
        (folder / f"run-{r['id']}.wandb").write_bytes(encode_log(body))
    return log


@command("scripts/bench_aggregate.py")
def main() -> int:
    """Make the runs, then time the aggregator on them."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=1000, help="number of run logs (default 1000)")
    p.add_argument("--steps", type=int, default=200, help="training log rows per run (default 200)")
    p.add_argument("--epochs", type=int, default=20, help="evaluation rows per run (default 20)")
    p.add_argument("--real", action="store_true", help="write every run with wandb instead of cloning")
    p.add_argument("--dir", type=Path, help="where to write the runs and keep them (default: a temp folder)")
    p.add_argument("--jobs", type=int, help="reader processes (default: the aggregator's own default)")
    args = p.parse_args()
    out = args.dir or Path(tempfile.mkdtemp(prefix="bench_aggregate_"))
    spec = plan(args.n)
    t0 = time.perf_counter()
    if args.real:
        write_real(spec, out, args.steps, args.epochs)
    else:
        clone(spec, out, args.steps, args.epochs)
    made = time.perf_counter() - t0
    logs = sorted(f for f in wandb_root(out).glob("*/run-*.wandb") if f.parent.name != "latest-run")
    size = sum(f.stat().st_size for f in logs)
    records = len(read_log(logs[0]).records)
    print(f"wrote {len(logs)} run logs ({size / 2**20:.1f} MiB, ~{records} records each) in {made:.1f} s: {out}")
    jobs = ["--jobs", str(args.jobs)] if args.jobs else []
    t0 = time.perf_counter()
    cli.main([str(wandb_root(out)), "--out", os.devnull, "-q", *jobs])
    in_process = time.perf_counter() - t0
    cmd = [sys.executable, str(ROOT / "scripts" / "aggregate.py"), str(wandb_root(out)), "--out", os.devnull, "-q"]
    t0 = time.perf_counter()
    subprocess.run(cmd + jobs, check=True)
    whole = time.perf_counter() - t0
    print(
        f"aggregate {len(logs)} runs: {in_process:.2f} s in-process, {whole:.2f} s as a command "
        f"(with interpreter start and imports) on {os.cpu_count()} cores"
    )
    t0 = time.perf_counter()
    subprocess.run(cmd + jobs + ["--curves", str(out / "curves.png")], check=True)
    curves = time.perf_counter() - t0
    print(
        f"with --curves (per-epoch history read from the logs in the same pass; no metrics.csv): {curves:.2f} s "
        f"as a command, {curves - whole:+.2f} s"
    )
    if args.dir is None:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
