"""Every file `deit-status`, the dry run and a relaunch read from a run folder or an output root may be damaged or
hostile (issue 52, point 5): a truncated, bit-flipped, oversized or crafted checkpoint, progress record, result,
identity, `.hydra` record, lock, log or SLURM record is the run's `damaged` row or one error line, read in bounded time
and memory; never a traceback, a hang or a MemoryError. The crafted pickles are written opcode by opcode here."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from deit_ablate.core.errors import ConfigError
from deit_ablate.record import checkpoint
from deit_ablate.record.resume import RESUME_KEYS, folder_action, peek_training_state
from deit_ablate.record.rundir import RunDir, runs_root
from tests.conftest import REPO

MEMORY_LIMIT = 1 << 30  # the status's address space, every file of the root read: 1 GB
SECONDS = 30  # the whole status of the root, in its own process


def plain_state(**values) -> dict:
    """A training state of plain values (what a checkpoint's data.pkl holds without its tensors)."""
    return {key: {} for key in RESUME_KEYS} | {"epoch": 1, "step": 7, "batches_done": 0, "best_top1": 0.0} | values


def archive(data_pkl: bytes, compress: bool = False) -> bytes:
    """A torch.save zip archive around `data_pkl`, with one storage record (`0`)."""
    out = io.BytesIO()
    kind = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(out, "w", kind) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/data/0", b"\0" * 16)
        zf.writestr("archive/version", b"3\n")
    return out.getvalue()


def zip_bomb(inflated: int) -> bytes:
    """An archive whose data.pkl inflates to `inflated` bytes of pickle opcodes (`N0`: push None, pop) from about a
    thousandth of that on disk: a reader that inflates it whole takes time and memory in proportion."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        with zf.open("archive/data.pkl", "w", force_zip64=True) as handle:
            handle.write(b"\x80\x02")
            chunk = b"N0" * (1 << 19)
            for _ in range(inflated // len(chunk)):
                handle.write(chunk)
        zf.writestr("archive/version", b"3\n")
    return out.getvalue()


def opcodes(*parts: bytes) -> bytes:
    """A protocol-2 pickle of the raw opcodes `parts`."""
    return b"\x80\x02" + b"".join(parts)


def real_checkpoint() -> bytes:
    """A checkpoint torch.save writes, with a model's state_dict (OrderedDict, _metadata) and optimizer moments."""
    import torch

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    out = io.BytesIO()
    torch.save(plain_state(model=model.state_dict(), optimizer=optimizer.state_dict()), out)
    return out.getvalue()


def tensor_step() -> bytes:
    import torch

    out = io.BytesIO()
    torch.save(plain_state(step=torch.tensor(7)), out)
    return out.getvalue()


def forged_directory(data: bytes) -> bytes:
    """`data` with the central directory's record of data.pkl saying it lies 2 GB into the file and is 2 GB long."""
    at = data.index(b"PK\x01\x02")  # the first record of the central directory: data.pkl, as torch.save writes it
    forged = bytearray(data)
    forged[at + 20:at + 28] = (0x7FFFFFF0).to_bytes(4, "little") * 2  # its compressed and inflated sizes
    forged[at + 42:at + 46] = (0x7FFFFFF0).to_bytes(4, "little")  # where its local header is
    return bytes(forged)


def flipped(data: bytes, seed: int, flips: int = 8) -> bytes:
    """`data` with `flips` random bits flipped (a seeded draw)."""
    draw, out = random.Random(seed), bytearray(data)
    for _ in range(flips):
        out[draw.randrange(len(out))] ^= 1 << draw.randrange(8)
    return bytes(out)


DEEP = 100_000
BOMB = 256 << 20  # bytes of opcodes in a 0.25 MB archive: 64 times what a peek inflates (MAX_PICKLE_BYTES)

# name -> the checkpoint's bytes; each must be refused (a damaged row, one line).
CRAFTED = {
    "step_2x": lambda: archive(pickle.dumps(plain_state(step="2x"), protocol=2)),
    "step_nan": lambda: archive(pickle.dumps(plain_state(step=float("nan")), protocol=2)),
    "step_float": lambda: archive(pickle.dumps(plain_state(step=7.0), protocol=2)),
    "step_negative": lambda: archive(pickle.dumps(plain_state(step=-1), protocol=2)),
    "step_bool": lambda: archive(pickle.dumps(plain_state(step=True), protocol=2)),
    "step_10e5000": lambda: archive(pickle.dumps(plain_state(step=10 ** 5000), protocol=2)),
    "step_10e5000_as_text": lambda: archive(pickle.dumps(plain_state(), protocol=0).replace(
        b"I7\n", b"L1" + b"0" * 5000 + b"L\n")),
    "step_10e15": lambda: archive(pickle.dumps(plain_state(step=10 ** 15), protocol=2)),
    "step_a_tensor": tensor_step,
    "best_top1_nan": lambda: archive(pickle.dumps(plain_state(best_top1=float("nan")), protocol=2)),
    "not_a_state": lambda: archive(pickle.dumps([1, 2, 3], protocol=2)),
    "string_of_2_40_bytes": lambda: archive(opcodes(b"\x8d", (1 << 40).to_bytes(8, "little"), b"abc.")),
    "bytes_of_2_40_bytes": lambda: archive(opcodes(b"\x8e", (1 << 40).to_bytes(8, "little"), b"abc.")),
    "memo_index_2_32": lambda: archive(opcodes(b"}r", (2 ** 32 - 2).to_bytes(4, "little"), b".")),
    "memo_get_unset": lambda: archive(opcodes(b"h\x05.")),
    "persistent_id_nested_deep": lambda: archive(opcodes(b"N", b"\x85" * DEEP, b"Q.")),
    "tuples_nested_deep": lambda: archive(opcodes(b"}N", b"\x85" * DEEP, b"Ns.")),
    "marks_nested_deep": lambda: archive(opcodes(b"(" * DEEP, b"N.")),
    "lists_nested_deep_by_appends": lambda: archive(opcodes(
        *(b"]r" + i.to_bytes(4, "little") for i in range(DEEP)),  # DEEP empty lists memoized, then each put
        *(b"j" + i.to_bytes(4, "little") + b"j" + (i + 1).to_bytes(4, "little") + b"a0" for i in range(DEEP - 1)),
        b".")),  # into the one before it, the outer one first
    "a_million_dicts": lambda: archive(opcodes(b"}" * (3 << 20), b".")),
    "a_global_os_system": lambda: archive(opcodes(b"cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R.")),
    "a_set": lambda: archive(opcodes(b"\x8f.")),
    "a_list_as_a_dict_key": lambda: archive(opcodes(b"}]Ns.")),
    "no_stop": lambda: archive(opcodes(b"}")),
    "storage_missing": lambda: archive(opcodes(b"(X\x07\x00\x00\x00storageNX\x01\x00\x00\x009NNtQ.")),
    "zip_bomb": lambda: zip_bomb(BOMB),
    "cut_short": lambda: real_checkpoint()[:700],
    "forged_directory": lambda: forged_directory(real_checkpoint()),
    "not_a_zip": lambda: b"\x00\x01garbage" * 100,
}


def checkpoint_root(tmp_path: Path, cases: dict[str, bytes]) -> Path:
    """An output root with a run folder per case, its checkpoint-last.pt the case's bytes, and a good one."""
    root = tmp_path / "outputs"
    for name, data in {**cases, "good": real_checkpoint()}.items():
        run = RunDir(runs_root(root) / name)
        run.hydra.mkdir(parents=True)
        run.hydra_overrides.write_text(f"[seed={len(name)}]\n")
        run.hydra_config.write_text("stage: pretrain\nseed: 0\n")
        run.last_checkpoint.write_bytes(data)
    return root


def limited_status(root: Path) -> subprocess.CompletedProcess:
    """`deit-status ROOT --json` in its own process, with at most MEMORY_LIMIT of address space and SECONDS."""
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
        from deit_ablate.analysis.status.cli import main
        sys.exit(main([sys.argv[1], "--json"]))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=SECONDS)


def rows_of(done: subprocess.CompletedProcess) -> dict[str, dict]:
    assert done.returncode == 0 and "Traceback" not in done.stderr and not done.stderr.strip(), done.stderr[-3000:]
    return {row["run"]: row for row in json.loads(done.stdout)["runs"]}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_checkpoint_is_refused_in_bounded_time_by_the_status_the_dry_run_and_a_relaunch(name, tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.last_checkpoint.write_bytes(CRAFTED[name]())
    for read in (folder_action, lambda r: checkpoint.find_resume_point(r.path)):  # the status and dry run; a launch
        start = time.monotonic()
        with pytest.raises(ConfigError) as raised:
            read(run)
        assert time.monotonic() - start < 5.0, name
        (line,) = str(raised.value).splitlines()
        assert "checkpoint-last.pt" in line and "cannot resume" in line, line


def test_the_zip_bomb_is_read_no_further_than_the_bound(tmp_path):
    """The archive inflates to 64 times resume.MAX_PICKLE_BYTES: refused after reading the bound, in well under a second
    (before: the whole inflated pickle was unpickled; at 6 GB from 6 MB the status was killed at 40 s)."""
    path = tmp_path / "bomb.pt"
    path.write_bytes(zip_bomb(BOMB))
    assert path.stat().st_size < BOMB // 500
    start = time.monotonic()
    with pytest.raises(ConfigError, match="inflates to more than"):
        peek_training_state(path)
    assert time.monotonic() - start < 2.0


def test_a_real_checkpoint_still_resumes_after_bit_flips_or_is_one_damaged_row(tmp_path):
    """Bit flips anywhere in a real checkpoint (its zip headers, its pickle, its tensors): each copy resumes from its
    step or is one damaged row, in the status's bounded process, never a traceback."""
    good = real_checkpoint()
    cases = {f"flipped_{seed}": flipped(good, seed) for seed in range(12)}
    cases |= {f"cut_at_{cut}": good[:cut] for cut in (1, 30, len(good) // 2, len(good) - 1)}
    rows = rows_of(limited_status(checkpoint_root(tmp_path, cases)))
    for name in cases:
        assert rows[name]["state"] == "damaged" or rows[name]["action"].startswith("resume from step"), rows[name]
    assert all(rows[f"cut_at_{cut}"]["state"] == "damaged" for cut in (1, 30, len(good) // 2)), rows
    assert rows["good"]["action"] == "resume from step 7 (checkpoint-last.pt)", rows["good"]


def test_every_crafted_checkpoint_is_one_damaged_row_in_bounded_time_and_memory(tmp_path):
    rows = rows_of(limited_status(checkpoint_root(tmp_path, {name: make() for name, make in CRAFTED.items()})))
    for name in CRAFTED:
        assert rows[name]["state"] == "damaged", rows[name]
        assert rows[name]["detail"].startswith("checkpoint-last.pt: "), rows[name]
    assert rows["good"]["action"] == "resume from step 7 (checkpoint-last.pt)", rows["good"]
    assert not (Path.cwd() / "true").exists()


# --- the run folder's other files --------------------------------------------------------------------------------

HUGE = 40 << 20  # bytes of a file grown past any record's bound (sparse: no disk used)


def sparse(path: Path, size: int = HUGE, head: bytes = b"") -> None:
    """`path` made `size` bytes long (sparse), starting with `head`."""
    path.write_bytes(head)
    os.truncate(path, size)


def yaml_alias_bomb(levels: int = 9) -> str:
    """A YAML list whose aliases expand to 10^levels strings: cheap to parse, endless to print."""
    lines = ["- &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"- &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


# name -> (what is done to a stopped run's folder, the file its damaged row names; None: any row, no traceback: a
# damaged result.json is a run to resume, whose launch writes it again)
RECORDS = {
    "progress_truncated": (lambda r: r.progress.write_text('{"state": "stopped", "step": 1'), "progress.json"),
    "progress_nested_deep": (lambda r: r.progress.write_text("[" * DEEP + "]" * DEEP), "progress.json"),
    "progress_oversized": (lambda r: sparse(r.progress, head=b'{"state": "stopped"}'), "progress.json"),
    "progress_10e5000": (lambda r: r.progress.write_text('{"step": ' + "9" * 5000 + "}"), "progress.json"),
    "progress_bit_flipped": (lambda r: r.progress.write_bytes(b'{"state": "st\xffpped", "step": 1}'),
                             "progress.json"),
    "result_nested_deep": (lambda r: r.result.write_text('{"status": ' + "[" * DEEP + "]" * DEEP + "}"), None),
    "result_oversized": (lambda r: sparse(r.result, head=b'{"status": "finished"}'), None),
    "identity_nested_deep": (lambda r: r.identity.write_text("{" + '"a": {' * DEEP + "}" * (DEEP + 1)), None),
    "hydra_config_nested_deep": (lambda r: r.hydra_config.write_text("- " * DEEP + "x\n"), ".hydra/config.yaml"),
    "hydra_config_oversized": (lambda r: sparse(r.hydra_config, head=b"stage: pretrain\nseed: 0\n"),
                               ".hydra/config.yaml"),
    "hydra_overrides_alias_bomb": (lambda r: r.hydra_overrides.write_text(yaml_alias_bomb()),
                                   ".hydra/overrides.yaml"),
    "hydra_overrides_flow_deep": (lambda r: r.hydra_overrides.write_text("[" * DEEP), ".hydra/overrides.yaml"),
    "lock_oversized": (lambda r: sparse(r.lock, head=b"{}"), None),
    "log_oversized": (lambda r: sparse(r.log, size=HUGE * 50, head=b"x ERROR y: boom\n"), None),
}


def records_root(tmp_path: Path) -> Path:
    """An output root with a stopped run folder per RECORDS case, damaged as it says, and a good one."""
    root = tmp_path / "outputs"
    good = real_checkpoint()
    for name, (damage, _) in {**RECORDS, "good": (lambda r: None, None)}.items():
        run = RunDir(runs_root(root) / name)
        run.hydra.mkdir(parents=True)
        run.hydra_overrides.write_text(f"[seed={len(name)}]\n")
        run.hydra_config.write_text("stage: pretrain\nseed: 0\n")
        run.last_checkpoint.write_bytes(good)
        run.progress.write_text(json.dumps({"state": "stopped", "step": 7, "epoch": 1}))
        run.identity.write_text(json.dumps({"name": name, "run_id": "x"}))
        damage(run)
    (runs_root(root) / "slurm-jobs.json").write_text("[" * DEEP)
    return root


def test_every_damaged_record_of_a_run_folder_is_one_row_in_bounded_time_and_memory(tmp_path):
    rows = rows_of(limited_status(records_root(tmp_path)))
    for name, (_, file) in RECORDS.items():
        if file is not None:
            assert rows[name]["state"] == "damaged" and rows[name]["detail"].startswith(f"{file}: "), rows[name]
    assert rows["good"]["state"] == "preempted", rows["good"]


# --- predictions.npz (python -m deit_ablate.disagreement, the aggregator's matrix) --------------------------------

def npz(**members: bytes) -> bytes:
    """A .npz archive of raw `<name>.npy` members (deflated, as np.savez_compressed writes them)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(f"{name}.npy", data)
    return out.getvalue()


def npy(header: str, body: bytes = b"") -> bytes:
    """An .npy member (format 1.0) with the header dict `header` as written, then `body`."""
    text = header.encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + body


def good_predictions() -> bytes:
    import numpy as np

    out = io.BytesIO()
    np.savez_compressed(out, main=np.arange(8, dtype=np.int16), labels=np.arange(8, dtype=np.int16),
                        index=np.arange(8, dtype=np.int32), meta=np.array(json.dumps({"model_name": "m"})))
    return out.getvalue()


META = npy("{'descr': '<U2', 'fortran_order': False, 'shape': (), }", "{}".encode("utf-32-le"))
INTS = npy("{'descr': '<i2', 'fortran_order': False, 'shape': (4,), }", b"\0" * 8)
PREDICTIONS = {
    "cut_short": lambda: good_predictions()[:200],
    "bit_flipped": lambda: flipped(good_predictions(), 3, flips=40),
    "a_header_of_2_40_items": lambda: npz(labels=npy("{'descr': '<i8', 'fortran_order': False, "
                                                     "'shape': (1099511627776,), }", b"\0" * 16),
                                          index=INTS, main=INTS, meta=META),
    "python_objects": lambda: npz(labels=npy("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
                                             pickle.dumps([os.system])), index=INTS, main=INTS, meta=META),
    "no_labels": lambda: npz(index=INTS, main=INTS, meta=META),
    "float_labels": lambda: npz(labels=npy("{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", b"\0" * 8),
                                index=INTS, main=INTS, meta=META),
    "meta_not_json": lambda: npz(labels=INTS, index=INTS, main=INTS,
                                 meta=npy("{'descr': '<U2', 'fortran_order': False, 'shape': (), }",
                                          "{[".encode("utf-32-le"))),
    "zip_bomb": lambda: npz(labels=npy("{'descr': '|u1', 'fortran_order': False, 'shape': (300000000,), }",
                                       bytes(300_000_000)), index=INTS, main=INTS, meta=META),
}


def test_every_damaged_predictions_file_is_one_line_in_bounded_time_and_memory(tmp_path):
    """Each file read in a process of at most 1 GB of address space (a 300 MB bomb, a header of 2^40 items), then
    through the disagreement's loader: one ConfigError line naming the file."""
    from deit_ablate.analysis.aggregate.disagree import load_predictions

    for name, make in PREDICTIONS.items():
        (tmp_path / name).mkdir()
        RunDir(tmp_path / name).predictions.write_bytes(make())
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
        from deit_ablate.record.rundir import RunDir
        from deit_ablate.record.runfiles import DamagedRecord
        for path in sys.argv[1:]:
            try:
                RunDir(__import__("pathlib").Path(path)).read_predictions()
            except DamagedRecord:
                pass
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script, *(str(tmp_path / name) for name in PREDICTIONS)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=SECONDS)
    assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
    for name in PREDICTIONS:
        run = RunDir(tmp_path / name)
        with pytest.raises(ConfigError) as raised:
            load_predictions(run)
        (line,) = str(raised.value).splitlines()
        assert line.startswith(f"{run.predictions}: ") and "predictions file" in line, (name, line)
