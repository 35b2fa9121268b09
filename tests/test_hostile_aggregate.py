"""Every file `deit-aggregate` reads from an output root may be damaged or hostile (issue 52, point 5): a truncated,
bit-flipped, oversized or crafted wandb log, metrics.csv, identity.json or result.json is one warning line naming the
file (its run skipped, or read in part), read in bounded time and memory; never a traceback, a hang or a MemoryError,
and every other run is still aggregated. Each output root here holds one good run and one run per damage of one kind
of file (each a clone of the session's tiny run under its own id and seed), aggregated once by the real command in a
process of at most 1 GB of address space."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from deit_ablate.analysis.aggregate.wandb_log import encode_log, read_log
from deit_ablate.record.rundir import RunDir, runs_root, wandb_root
from tests.conftest import REPO, SharedRun

MEMORY_LIMIT = 1 << 30  # the aggregator's address space: 1 GB
SECONDS = 60  # one aggregation of a root, in its own process
DEEP = 100_000
HUGE = 1200 << 20  # a sparse log above the memory limit: read whole, it cannot fit


def records_of(log: Path) -> list:
    """The parsed records of a wandb log."""
    from wandb.proto.wandb_internal_pb2 import Record

    out = []
    for payload in read_log(log).records:
        record = Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def run_record(records: list):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def config_item(records: list, key: str):
    return next(item for item in run_record(records).config.update if item.key == key)


def write_log(log: Path, records: list) -> None:
    log.write_bytes(encode_log(r.SerializeToString() for r in records))


def sparse(path: Path, size: int, head: bytes = b"", tail: bytes = b"") -> None:
    """`path` made `size` bytes long (sparse: no disk used), starting with `head` and ending with `tail`."""
    path.write_bytes(head)
    os.truncate(path, size - len(tail))
    with path.open("ab") as handle:
        handle.write(tail)


def put(path: Path, data: bytes | str) -> Path:
    """`path` with `data` written into it; the path."""
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def flipped(data: bytes, seed: int, flips: int = 8) -> bytes:
    draw, out = random.Random(seed), bytearray(data)
    for _ in range(flips):
        out[draw.randrange(len(out))] ^= 1 << draw.randrange(8)
    return bytes(out)


def replaced(path: Path, kind: str) -> None:
    """`path` replaced by a FIFO, a folder or a link to itself."""
    path.unlink()
    {"fifo": os.mkfifo, "folder": os.mkdir, "loop": lambda p: os.symlink(p.name, p)}[kind](path)


class Victim:
    """A clone of the tiny run in an output root: its wandb log (`log`), its run folder (`run`), its records."""

    def __init__(self, root: Path, template: SharedRun, name: str, seed: int) -> None:
        self.run_id, self.name = f"hostile{seed:04d}", f"hostile-{name}"
        (source,) = wandb_root(template.outputs).glob("offline-run-*/run-*.wandb")  # not its latest-run link
        self.records = records_of(source)
        run = run_record(self.records)
        run.run_id = run.display_name = self.run_id
        for key, value in (("seed", seed), ("run_id", self.run_id), ("run_name", self.name)):
            config_item(self.records, key).value_json = json.dumps(value)
        self.log = wandb_root(root) / f"offline-run-20260101_000000-{self.run_id}" / f"run-{self.run_id}.wandb"
        self.log.parent.mkdir(parents=True)
        write_log(self.log, self.records)
        self.run = RunDir(runs_root(root) / self.name)
        self.run.path.mkdir(parents=True)
        good = RunDir(template.run_dir())
        self.run.metrics.write_bytes(good.metrics.read_bytes())
        self.run.result.write_text(json.dumps({**json.loads(good.result.read_text()), "run_id": self.run_id}))
        self.run.identity.write_text(json.dumps({**json.loads(good.identity.read_text()), "run_id": self.run_id,
                                                 "name": self.name}))

    def edit(self, change: Callable[[list], object]) -> Path:
        """Its log written again after `change` edits its records; the log."""
        change(self.records)
        write_log(self.log, self.records)
        return self.log

    def without_run_record(self) -> None:
        """Its log cut before its run record (a launch killed within a second of starting wandb)."""
        write_log(self.log, [r for r in self.records if r.WhichOneof("record_type") == "header"])


def set_config(key: str, value_json: str) -> Callable[[list], object]:
    return lambda records: setattr(config_item(records, key), "value_json", value_json)


def set_nested(key: str, **values: object) -> Callable[[list], object]:
    """The config group `key` with `values` set in it."""
    def change(records: list) -> None:
        item = config_item(records, key)
        item.value_json = json.dumps({**json.loads(item.value_json), **values})

    return change


def set_model(**values: object) -> Callable[[list], object]:
    return set_nested("model", **values)


def add_summary(key: str | list[str], value_json: str) -> Callable[[list], object]:
    """A summary record setting `key` (a list: a nested key) to `value_json`, before the log's last record."""
    def change(records: list) -> None:
        from wandb.proto.wandb_internal_pb2 import Record

        record = Record()
        item = record.summary.update.add()
        if isinstance(key, list):
            item.nested_key.extend(key)
        else:
            item.key = key
        item.value_json = value_json
        records.insert(len(records) - 1, record)

    return change


def as_is(change: Callable[[list], object]) -> Callable[[Victim], None]:
    """A damage of the log's values that the aggregator reads as they are (none it can tell from a real value): no
    file to name, only no traceback."""
    return lambda v: v.edit(change) and None


def many_summary_keys(records: list) -> None:
    """A summary record of 300,000 keys (a few MB that a reader would keep as 300,000 values)."""
    from wandb.proto.wandb_internal_pb2 import Record

    record = Record()
    for key in range(300_000):
        item = record.summary.update.add()
        item.key, item.value_json = f"k{key}", "1"
    records.insert(len(records) - 1, record)


def deep_key(records: list) -> None:
    item = run_record(records).config.update.add()
    item.nested_key.extend(["k"] * DEEP)
    item.value_json = "1"


def far_start(records: list) -> None:
    run_record(records).start_time.seconds = 1 << 62


def huge_record(v: Victim) -> Path:
    """A history record of 40 MB (one value) before the log's last one, past the 16 MB a record is read to."""
    from wandb.proto.wandb_internal_pb2 import Record

    record = Record()
    item = record.history.item.add()
    item.key, item.value_json = "train/blob", json.dumps("x" * (40 << 20))
    return v.edit(lambda records: records.insert(len(records) - 1, record))


def epoch_row_damaged(epoch: str) -> Callable[[Victim], Path]:
    """An epoch row of the log whose epoch is `epoch`, the run folder's metrics.csv gone (the log's rows read)."""
    def damage(v: Victim) -> Path:
        v.run.metrics.unlink()
        for record in v.records:
            for item in record.history.item if record.WhichOneof("record_type") == "history" else ():
                if (item.key or "/".join(item.nested_key)) == "epoch":
                    item.value_json = epoch
        return v.edit(lambda records: None)

    return damage


def metrics(text: str | bytes) -> Callable[[Victim], Path]:
    return lambda v: put(v.run.metrics, text)


HEADER = "epoch,step,train/loss,val/top1\n"

# file kind -> case -> what it does to a victim; returns the damaged file the output must name (None: any output
# but a traceback; a value the aggregator cannot tell from a real one)
DAMAGE: dict[str, dict[str, Callable[[Victim], Path | None]]] = {
    "log": {
        "truncated_half": lambda v: put(v.log, v.log.read_bytes()[: v.log.stat().st_size // 2]),
        "truncated_in_header": lambda v: put(v.log, v.log.read_bytes()[:5]),
        **{f"bit_flipped_{seed}": (lambda s: lambda v: put(v.log, flipped(v.log.read_bytes(), s)))(
            seed) for seed in range(4)},
        "not_a_log": lambda v: put(v.log, b"\x00garbage\xff" * 1000),
        "empty": lambda v: put(v.log, b""),
        "oversized_sparse": lambda v: sparse(v.log, HUGE, v.log.read_bytes(), b"tail") or v.log,
        "a_record_of_40_mb": huge_record,
        "above_the_cap": lambda v: sparse(v.log, (4 << 30) + 1, v.log.read_bytes()) or v.log,
        "a_fifo": lambda v: replaced(v.log, "fifo") or v.log,
        "a_folder": lambda v: replaced(v.log, "folder") or v.log,
        "a_symlink_loop": lambda v: replaced(v.log, "loop") or v.log,
    },
    "log_values": {
        "config_nested_deep": lambda v: v.edit(set_config("augment", "[" * DEEP + "]" * DEEP)),
        "config_nested_900": lambda v: v.edit(set_config("augment", "[" * 900 + "]" * 900)),
        "config_key_nested_deep": lambda v: v.edit(deep_key),
        "config_value_of_2_mb": lambda v: v.edit(set_config("augment", json.dumps("x" * (2 << 20)))),
        "summary_nested_deep": lambda v: v.edit(add_summary("top1", "[" * DEEP + "]" * DEEP)),
        "summary_key_nested_deep": lambda v: v.edit(add_summary(["k"] * DEEP, "1")),
        "summary_of_300k_keys": lambda v: v.edit(many_summary_keys),
        "start_time_after_year_9999": lambda v: v.edit(far_start),
        "summary_top1_10e400": as_is(add_summary("top1", "1" + "0" * 400)),
        "summary_top1_10e5000": as_is(add_summary("top1", "1" + "0" * 5000)),
        "summary_top1_1e5000": as_is(add_summary("top1", "1e5000")),
        "summary_status_a_list": as_is(add_summary("status", "[1]")),
        "seed_nan": as_is(set_config("seed", "NaN")),
        "seed_a_dict": as_is(set_config("seed", '{"a": 1}')),
        "seed_10e400": as_is(set_config("seed", "1" + "0" * 400)),
        "run_name_a_path": as_is(set_config("run_name", json.dumps("../../../hostile-good"))),
        "run_name_a_list": lambda v: v.edit(set_config("run_name", "[1, 2]")),
        "choices_a_list": lambda v: v.edit(set_config("choices", "[1, 2]")),
        "model_a_list": lambda v: v.edit(set_config("model", "[1, 2]")),
        "stage_a_dict": lambda v: v.edit(set_config("stage", '{"a": []}')),
        "distill_a_list": lambda v: v.edit(set_config("distill", "[1, 2]")),
        "model_name_a_list": lambda v: v.edit(set_model(name=[1])),
        "model_kwargs_a_text": lambda v: v.edit(set_model(kwargs="x")),
        "data_fingerprint_digest_a_list": lambda v: v.edit(set_nested("data_fingerprint", digest=[1])),
        "architecture_params_a_list": as_is(add_summary("architecture", '{"name": "m", "params": [1]}')),
        "epoch_inf": lambda v: epoch_row_damaged("Infinity")(v),
        "epoch_nan": lambda v: epoch_row_damaged("NaN")(v),
        "epoch_a_text": lambda v: epoch_row_damaged('"x"')(v),
    },
    "metrics.csv": {
        "truncated_mid_row": metrics(HEADER + "0,8,2.3,10.0\n1,1"),
        "a_row_too_long": metrics(HEADER + "0,8,2.3,10.0,7,7\n"),
        "epoch_inf": metrics(HEADER + "inf,8,2.3,10.0\n"),
        "epoch_nan": metrics(HEADER + "nan,8,2.3,10.0\n"),
        "epoch_1e5000": metrics(HEADER + "1e5000,8,2.3,10.0\n"),
        "epoch_negative": metrics(HEADER + "-1,8,2.3,10.0\n"),
        "epoch_a_text": metrics(HEADER + "x,8,2.3,10.0\n"),
        "bit_flipped": metrics((HEADER + "0,8,2.3,10.0\n").encode().replace(b"2.3", b"2\xff3")),
        "a_nul_byte": metrics(HEADER + "\x000,8,2.3,10.0\n"),
        "a_field_of_1_mb": metrics(HEADER + "0,8," + "9" * (1 << 20) + ",10.0\n"),
        "a_line_of_20_mb": metrics(HEADER + "9" * (20 << 20) + "\n"),
        "oversized_sparse": lambda v: sparse(v.run.metrics, 40 << 20, HEADER.encode()) or v.run.metrics,
        "a_fifo": lambda v: replaced(v.run.metrics, "fifo") or v.run.metrics,
        "a_folder": lambda v: replaced(v.run.metrics, "folder") or v.run.metrics,
        "a_symlink_loop": lambda v: replaced(v.run.metrics, "loop") or v.run.metrics,
    },
    "run_folder": {  # a log cut before its run record: the run read from its run folder
        "identity_nested_deep": lambda v: put(v.run.identity, "{" + '"a": {' * DEEP + "}" * (DEEP + 1)),
        "identity_truncated": lambda v: put(v.run.identity, v.run.identity.read_text()[:30]),
        "identity_a_list": lambda v: put(v.run.identity, "[1]"),
        "identity_oversized": lambda v: sparse(v.run.identity, 40 << 20, b"{}") or v.run.identity,
        "identity_a_fifo": lambda v: replaced(v.run.identity, "fifo") or v.run.identity,
        "result_nested_deep": lambda v: put(v.run.result, '{"status": ' + "[" * DEEP + "]" * DEEP + "}"),
        "result_bit_flipped": lambda v: put(v.run.result, v.run.result.read_bytes()[:-3] + b"\xff}"),
        "result_a_folder": lambda v: replaced(v.run.result, "folder") or v.run.result,
        "result_top1_10e400": lambda v: put(v.run.result, json.dumps({"status": "finished", "top1": 10**400}))
        and None,
        "metrics_epoch_inf": metrics(HEADER + "inf,8,2.3,10.0\n"),
    },
}


def aggregated_root(tmp: Path, template: SharedRun, kind: str) -> tuple[dict[str, Path | None], dict[str, str]]:
    """An output root with the good run and one victim per DAMAGE[kind] case; the file each case damaged, the run id
    of each case (`good` too)."""
    root = tmp / "outputs"
    good = Victim(root, template, "good", 0)
    named, ids = {}, {"good": good.run_id}
    for seed, (case, damage) in enumerate(sorted(DAMAGE[kind].items()), 1):
        victim = Victim(root, template, case, seed)
        if kind == "run_folder":
            victim.without_run_record()
        named[case], ids[case] = damage(victim), victim.run_id
    return named, ids


def limited_aggregate(root: Path, curves: Path | None) -> subprocess.CompletedProcess:
    """`deit-aggregate ROOT --format json` (and `--curves`: the per-epoch rows read) by its entry point, in its own
    process with at most MEMORY_LIMIT of address space and SECONDS."""
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
        from deit_ablate.run.commands import deit_aggregate
        sys.argv = ["deit-aggregate", *sys.argv[1:]]
        sys.exit(deit_aggregate())
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    args = [str(root), "--format", "json", "--paper", "none", *(["--curves", str(curves)] if curves else [])]
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=SECONDS)


@pytest.fixture(scope="module")
def aggregations(tiny_run: SharedRun, tmp_path_factory: pytest.TempPathFactory):
    """Per file kind (on first use): the output of aggregating its root, the file each case damaged, the run ids."""
    done: dict[str, tuple[subprocess.CompletedProcess, dict[str, Path | None], dict[str, str]]] = {}

    def get(kind: str):
        if kind not in done:
            tmp = tmp_path_factory.mktemp(f"hostile_{kind.replace('.', '_')}")
            named, ids = aggregated_root(tmp, tiny_run, kind)
            curves = tmp / "curves.png" if kind in ("metrics.csv", "log_values", "run_folder") else None
            done[kind] = (limited_aggregate(tmp / "outputs", curves), named, ids)
        return done[kind]

    return get


def counted(out: str) -> set[str]:
    """The run ids the json table's cells count."""
    table = json.loads(out)
    return {rid for row in table["rows"] for cell in row["cells"].values() for rid in cell["run_ids"]}


@pytest.mark.parametrize("kind,case", [(kind, case) for kind, cases in DAMAGE.items() for case in sorted(cases)])
def test_a_damaged_file_is_one_warning_and_every_other_run_is_aggregated(kind, case, aggregations):
    done, named, ids = aggregations(kind)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert all(line.startswith("warning: ") for line in lines[:-1]) and " counted" in lines[-1], lines
    assert ids["good"] in counted(done.stdout), done.stderr[-3000:]
    if named[case] is not None:
        said = [line for line in lines if f"{named[case]}:" in line]
        assert said, (case, done.stderr[-3000:])


def test_a_record_above_the_bound_is_skipped_and_the_records_after_it_are_read(tmp_path):
    """The framing reads a record of more than MAX_RECORD_BYTES chunk by chunk without gathering it, and goes on with
    the next record; cut inside such a record, the log ends there."""
    from deit_ablate.analysis.aggregate.wandb_log import MAX_RECORD_BYTES

    records = [b"a" * 100, bytes(MAX_RECORD_BYTES + 1), b"b" * 70_000, b"c"]
    blob = encode_log(records)
    log = put(tmp_path / "run-x.wandb", blob)
    read = read_log(log)
    assert read.records == [records[0], *records[2:]] and read.problem is None and read.skipped == [7 + 7 + 100]
    read = read_log(put(log, blob[: MAX_RECORD_BYTES // 2]))
    assert read.records == records[:1] and read.problem.startswith("cut inside a multi-block record")


def test_a_where_value_nested_too_deep_is_matched_as_text(tmp_path):
    """`--where seed=[[[...` (100,000 deep) is taken as text, not a RecursionError."""
    from deit_ablate.analysis.aggregate.select import _typed

    assert _typed("[" * DEEP) == "[" * DEEP
