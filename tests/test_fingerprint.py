"""The data fingerprint: by content (paths and sizes), not by location; cached against folder mtimes and every
file's size and mtime."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deit_ablate.core import atomic
from deit_ablate.data import fingerprint as F
from deit_ablate.data.fingerprint import CACHE_NAME, dataset_fingerprint, describe_fingerprint

TREE = {
    "train": {"cat": [3, 5, 7], "dog": [2, 4], "eel": [1]},
    "val": {"cat": [3], "dog": [9, 9], "eel": [6]},
}


def make_tree(root, tree=TREE):
    """An ImageFolder tree whose files hold n bytes each, with every folder's mtime an hour old."""
    for split, classes in tree.items():
        for cls, sizes in classes.items():
            (root / split / cls).mkdir(parents=True)
            for i, n in enumerate(sizes):
                (root / split / cls / f"img{i}.jpg").write_bytes(b"x" * n)
    age(root)
    return root


def age(root):
    """Set every folder's mtime an hour back, as for data that is not being written (else it is too fresh to cache)."""
    past = time.time() - 3600
    for d, _, _ in os.walk(root):
        os.utime(d, (past, past))


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The fallback cache folder, away from ~/.cache."""
    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(tmp_path / "cachehome"))
    return tmp_path / "cachehome" / "fingerprints"


@pytest.fixture
def scans(monkeypatch):
    """Counts the class-folder scans, to tell a cache hit (none) from a computation."""
    calls = []
    real = F._scan_class

    def counted(folder, rel):
        calls.append(rel)
        return real(folder, rel)

    monkeypatch.setattr(F, "_scan_class", counted)
    return calls


def digest(root, **kw):
    return dataset_fingerprint(root, **kw)["digest"]


def test_counts_classes_and_description(tmp_path):
    fp = dataset_fingerprint(make_tree(tmp_path / "d"))
    assert fp["images"] == {"train": 6, "val": 4} and fp["classes"] == 3
    assert len(fp["digest"]) == 16 and int(fp["digest"], 16) >= 0
    assert json.loads(json.dumps(fp)) == fp
    assert describe_fingerprint(fp) == f"3 classes, 6 train / 4 val images, digest {fp['digest']}"


def test_nested_files_count_loose_and_hidden_ones_do_not(tmp_path):
    root = make_tree(tmp_path / "d")
    (root / "train" / "cat" / "sub").mkdir()
    (root / "train" / "cat" / "sub" / "deep.jpg").write_bytes(b"y")
    (root / "train" / "loose.jpg").write_bytes(b"z")  # not under a class folder
    (root / "train" / ".hiddenclass").mkdir()
    (root / "train" / ".hiddenclass" / "a.jpg").write_bytes(b"z")
    fp = dataset_fingerprint(root)
    assert fp["images"] == {"train": 7, "val": 4} and fp["classes"] == 3


def test_an_image_only_tree_keeps_the_digest_it_had_before_the_file_rule(tmp_path):
    """The dataset's file rule (#26) changed what is left out, not the digest of a tree of images (this one's, computed
    by the code before it): runs recorded before keep their identity."""
    assert digest(make_tree(tmp_path / "d")) == "15163f5985649ae4"


def test_files_the_dataset_does_not_read_are_left_out_and_named(tmp_path):
    root = make_tree(tmp_path / "d")
    before = dataset_fingerprint(root)
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    (root / "train" / "cat" / ".ipynb_checkpoints").mkdir()
    (root / "train" / "cat" / ".ipynb_checkpoints" / "img0-checkpoint.jpg").write_bytes(b"x")
    after = dataset_fingerprint(root)
    assert after["digest"] == before["digest"] and after["images"] == before["images"]
    assert after["not_read"] == {"files": 1, "first": ["train/cat/notes.txt"]}


def test_a_cache_written_before_the_file_rule_is_recomputed(tmp_path, scans):
    root = make_tree(tmp_path / "d")
    good = dataset_fingerprint(root)
    entry = json.loads((root / CACHE_NAME).read_text())
    entry["version"], entry["fingerprint"]["images"]["train"] = 1, 7  # as version 1 counted a stray notes.txt
    (root / CACHE_NAME).write_text(json.dumps(entry))
    n = len(scans)
    assert dataset_fingerprint(root) == good and len(scans) > n


def test_missing_val_split_counts_zero(tmp_path):
    fp = dataset_fingerprint(make_tree(tmp_path / "d", {"train": TREE["train"]}))
    assert fp["images"] == {"train": 6, "val": 0} and fp["classes"] == 3
    assert dataset_fingerprint(tmp_path / "nowhere")["images"] == {"train": 0, "val": 0}


def test_class_names_digest_follows_names_only(tmp_path):
    a = dataset_fingerprint(make_tree(tmp_path / "a"))
    b = dataset_fingerprint(make_tree(tmp_path / "b", {"train": {"cat": [1], "dog": [1], "eel": [1]}}))
    c = dataset_fingerprint(make_tree(tmp_path / "c", {"train": {"cat": [1], "dog": [1], "fox": [1]}}))
    assert a["class_names_digest"] == b["class_names_digest"] != c["class_names_digest"]


def test_copied_tree_keeps_the_digest_and_is_computed_afresh(tmp_path, scans):
    src = make_tree(tmp_path / "src")
    before = digest(src)
    assert (src / CACHE_NAME).exists()  # copied along: its root no longer matches, so it must not be trusted
    shutil.copytree(src, tmp_path / "mnt" / "elsewhere")
    scans.clear()
    assert digest(tmp_path / "mnt" / "elsewhere") == before and scans


def mutate_add(root):
    (root / "train" / "dog" / "new.jpg").write_bytes(b"n")


def mutate_remove(root):
    (root / "val" / "eel" / "img0.jpg").unlink()


def mutate_rename(root):
    (root / "train" / "cat" / "img1.jpg").rename(root / "train" / "cat" / "renamed.jpg")


def mutate_move_across_classes(root):
    (root / "train" / "cat" / "img2.jpg").rename(root / "train" / "dog" / "img2.jpg")


def mutate_rename_class(root):
    (root / "val" / "dog").rename(root / "val" / "wolf")


def mutate_add_empty_class(root):
    (root / "val" / "fox").mkdir()


@pytest.mark.parametrize("mutate", [mutate_add, mutate_remove, mutate_rename, mutate_move_across_classes,
                                    mutate_rename_class, mutate_add_empty_class])
def test_a_change_gives_another_digest_and_invalidates_the_cache(tmp_path, scans, mutate):
    root = make_tree(tmp_path / "d")
    before = digest(root)
    assert digest(root) == before  # cached now
    n = len(scans)
    mutate(root)
    after = digest(root)
    assert after != before and len(scans) > n


def test_a_file_added_in_a_nested_folder_invalidates_the_cache(tmp_path, scans):
    root = make_tree(tmp_path / "d")
    (root / "train" / "eel" / "sub").mkdir()
    age(root)
    before = digest(root)
    n = len(scans)
    (root / "train" / "eel" / "sub" / "img0.jpg").write_bytes(b"x")  # changes sub's mtime only, not eel's
    assert digest(root) != before and len(scans) > n


def test_a_resized_file_gives_another_digest(tmp_path):
    a = make_tree(tmp_path / "a")
    b = make_tree(tmp_path / "b", {**TREE, "val": {**TREE["val"], "eel": [7]}})
    assert digest(a) != digest(b)


def rewrite_in_place(files: list[Path], extra: bytes = b"\0" * 7) -> None:
    """Rewrite each file in place (the same inode, its folder's mtime untouched) with `extra` bytes more."""
    for path in files:
        inode = path.stat().st_ino
        with open(path, "r+b") as handle:
            data = handle.read()
            handle.seek(0)
            handle.write(data + extra)
        assert path.stat().st_ino == inode


def test_rewriting_every_val_image_in_place_changes_the_digest_and_the_cache(tmp_path, scans):
    """Folder mtimes do not move when files are rewritten in place: the stamp holds every file's size and mtime."""
    root = make_tree(tmp_path / "d")
    before = digest(root)
    assert digest(root) == before and json.loads((root / CACHE_NAME).read_text())["fingerprint"]["digest"] == before
    n = len(scans)
    rewrite_in_place(sorted((root / "val").rglob("*.jpg")))
    after = digest(root)
    assert after != before and len(scans) > n  # it was the cached digest of the old files
    assert after == digest(make_tree(tmp_path / "fresh", {**TREE, "val": {c: [k + 7 for k in sizes]
                                                                          for c, sizes in TREE["val"].items()}}))


def test_hidden_files_do_not_change_the_digest(tmp_path, scans):
    root = make_tree(tmp_path / "d")
    before = digest(root)
    (root / "train" / "cat" / ".DS_Store").write_bytes(b"junk")
    (root / "val" / ".DS_Store").write_bytes(b"junk")
    (root / "train" / "cat" / "._img0.jpg").write_bytes(b"junk")
    n = len(scans)
    assert digest(root) == before and len(scans) > n  # recomputed (folder mtimes moved), same digest


def test_second_call_reads_the_cache(tmp_path, monkeypatch):
    root = make_tree(tmp_path / "d")
    first = dataset_fingerprint(root)
    assert json.loads((root / CACHE_NAME).read_text())["fingerprint"] == first

    def boom(*a):
        raise AssertionError("scanned a class folder although the cache holds")

    monkeypatch.setattr(F, "_scan_class", boom)
    assert dataset_fingerprint(root) == first
    assert dataset_fingerprint(str(root) + "/.") == first  # the cache is keyed by the resolved root


def test_a_tree_changed_just_now_is_not_cached_yet(tmp_path, scans):
    """A second change within the same mtime tick would keep the stamp, so a fresh tree is only cached once settled."""
    root = make_tree(tmp_path / "d")
    (root / "val" / "cat" / "new.jpg").write_bytes(b"n")
    dataset_fingerprint(root)
    assert not (root / CACHE_NAME).exists()
    n = len(scans)
    dataset_fingerprint(root)
    assert len(scans) > n
    age(root)
    dataset_fingerprint(root)
    assert (root / CACHE_NAME).exists()


def test_unwritable_root_caches_in_cache_dir(tmp_path, monkeypatch, scans):
    """Simulated by failing the temp-file creation in the root, which is the write test the code uses (atomic.py's
    temp file; tests run as root here, where chmod does not stop writes; the next test does it with chmod where it
    can)."""
    root = make_tree(tmp_path / "d")
    real = atomic.create_unique

    def create_unique(parent, *a, **kw):
        if os.path.samefile(parent, root):
            raise PermissionError(13, "Permission denied", str(parent))
        return real(parent, *a, **kw)

    monkeypatch.setattr(atomic, "create_unique", create_unique)
    fp = dataset_fingerprint(root, cache_dir=tmp_path / "cache")
    assert not (root / CACHE_NAME).exists()
    [cached] = (tmp_path / "cache").iterdir()
    assert json.loads(cached.read_text())["fingerprint"] == fp
    n = len(scans)
    assert dataset_fingerprint(root, cache_dir=tmp_path / "cache") == fp and len(scans) == n


def test_unwritable_root_without_cache_dir_uses_the_default(tmp_path, monkeypatch, cache_home):
    root = make_tree(tmp_path / "d")
    monkeypatch.setattr(F, "_write", lambda path, data, real=F._write: path.parent != root and real(path, data))
    fp = dataset_fingerprint(root)
    assert [json.loads(p.read_text())["fingerprint"] for p in cache_home.iterdir()] == [fp]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through chmod")
def test_read_only_root_by_chmod(tmp_path):
    root = make_tree(tmp_path / "d")
    os.chmod(root, 0o555)
    try:
        fp = dataset_fingerprint(root, cache_dir=tmp_path / "cache")
    finally:
        os.chmod(root, 0o755)
    assert not (root / CACHE_NAME).exists() and len(list((tmp_path / "cache").iterdir())) == 1
    assert fp["images"] == {"train": 6, "val": 4}


@pytest.mark.parametrize("garbage", [b"", b"\xff\xfe not utf-8", b"{\"version\": 1, \"root", b"[1, 2]", b"null",
                                     b'{"version": 1}', "nested", "fingerprint"])
def test_corrupt_cache_is_recomputed_and_rewritten(tmp_path, scans, garbage):
    root = make_tree(tmp_path / "d")
    good = dataset_fingerprint(root)
    cache = root / CACHE_NAME
    if isinstance(garbage, str):  # a well-formed file with one field of the wrong type
        entry = json.loads(cache.read_text())
        entry[garbage] = 5
        garbage = json.dumps(entry).encode()
    cache.write_bytes(garbage)
    n = len(scans)
    assert dataset_fingerprint(root) == good and len(scans) > n
    assert json.loads(cache.read_text())["fingerprint"] == good


def test_thread_pool_and_serial_scans_agree(tmp_path, monkeypatch):
    """Scans finishing out of order (the first class slowest) must not change the digest."""
    tree = {"train": {f"c{i:02d}": [i % 5 + 1] * (i % 3 + 1) for i in range(12)}, "val": {"c00": [1], "c05": [2]}}
    root = make_tree(tmp_path / "d", tree)
    real, pools = F._scan_class, []

    def slow(folder, rel):
        time.sleep(0.002 * (20 - int(rel[-2:])))
        return real(folder, rel)

    class Pool(F.ThreadPoolExecutor):
        def __init__(self, n):
            pools.append(n)
            super().__init__(n)

    monkeypatch.setattr(F, "_scan_class", slow)
    monkeypatch.setattr(F, "ThreadPoolExecutor", Pool)
    serial = dataset_fingerprint(root, workers=1, refresh=True)
    assert pools == []
    pooled = dataset_fingerprint(root, workers=8, refresh=True)
    assert set(pools) == {8} and pooled == serial  # the stamp of the files and the computation


READ_ONLY = """
import json, os, sys
from pathlib import Path
from deit_ablate.data import fingerprint as F
root = Path(sys.argv[1])
try:
    (root / "probe").write_text("x")
    writable = True
except OSError:
    writable = False
fp = F.dataset_fingerprint(root)
F._scan_class = None  # a second call must come from the cache
print(json.dumps({"writable": writable, "fp": fp, "again": F.dataset_fingerprint(root)}))
"""


READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'  # sh -c: $0 read-only


def read_only(folder: Path) -> list[str]:
    """A command prefix that runs the rest with `folder` bind-mounted read-only onto itself, in a private mount
    namespace: the mount ends with the command, whatever happens to it."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", READ_ONLY_MOUNT, str(folder)]


def read_only_mount_works() -> bool:
    """Whether this process may make a private mount namespace with a read-only bind mount (root, unshare)."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount --bind /tmp /tmp && mount -o remount,ro,bind /tmp"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not read_only_mount_works(), reason="needs root and mount namespaces (unshare -m) to mount "
                    "the data read-only; test_unwritable_root_caches_in_cache_dir simulates it instead")
def test_a_read_only_data_folder_caches_its_fingerprint_in_the_cache_folder(tmp_path, cache_home):
    """#26 point 9: the data folder bind-mounted read-only onto itself in a private mount namespace (root writes
    through chmod, not through a read-only mount); the mount ends with the process."""
    root = make_tree(tmp_path / "d")
    proc = subprocess.run(read_only(root) + [sys.executable, "-c", READ_ONLY, str(root)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert not seen["writable"] and seen["again"] == seen["fp"]
    assert sorted(p.name for p in root.iterdir()) == ["train", "val"]  # nothing written into the data folder
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    assert json.loads((cache_home / f"{key}.json").read_text())["fingerprint"] == seen["fp"]
    assert dataset_fingerprint(root)["digest"] == seen["fp"]["digest"]  # the same data, writable again
