"""Workdir bundles: deterministic packing, .gitignore-style excludes, limits, safe unpacking."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from worker_agent.bundle import (
    BundleError,
    pack_directory,
    prune_cache,
    sha256_of,
    unpack_bundle,
)


def _tree(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "job.py").write_text("def job():\n    return {}\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "job.cpython-311.pyc").write_bytes(b"\0")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"x" * 100)
    (root / "notes.log").write_text("log")
    (root / "keep.log").write_text("kept by a negation")
    (root / ".gitignore").write_text("data/\n*.log\n!keep.log\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")


def test_pack_leaves_out_ignored_files_and_is_deterministic(tmp_path: Path) -> None:
    _tree(tmp_path / "a")
    bundle = pack_directory(tmp_path / "a")
    assert bundle.files == [".gitignore", "keep.log", "pkg/__init__.py", "pkg/job.py"]
    assert bundle.sha256 == sha256_of(bundle.data)
    # The same files elsewhere, written later, give the same bytes.
    _tree(tmp_path / "b")
    assert pack_directory(tmp_path / "b").sha256 == bundle.sha256
    (tmp_path / "b" / "pkg" / "job.py").write_text("def job():\n    return None\n")
    assert pack_directory(tmp_path / "b").sha256 != bundle.sha256


def test_unpack_checks_the_hash_and_caches(tmp_path: Path) -> None:
    _tree(tmp_path / "src")
    bundle = pack_directory(tmp_path / "src")
    cache = tmp_path / "cache"
    dest = unpack_bundle(bundle.data, bundle.sha256, cache)
    assert dest == cache / bundle.sha256
    assert (dest / "pkg" / "job.py").read_text().startswith("def job")
    assert not (dest / "data").exists()
    assert unpack_bundle(bundle.data, bundle.sha256, cache) == dest  # cached
    with pytest.raises(BundleError, match="hashes to"):
        unpack_bundle(bundle.data + b"x", bundle.sha256, cache)


def test_limits_and_bad_archives(tmp_path: Path) -> None:
    _tree(tmp_path / "src")
    (tmp_path / "src" / "weights.bin").write_bytes(b"y" * 5000)
    with pytest.raises(BundleError, match="over the 1000-byte limit"):
        pack_directory(tmp_path / "src", max_unpacked_bytes=1000)
    with pytest.raises(BundleError, match="not a directory"):
        pack_directory(tmp_path / "missing")
    # An archive whose member escapes the directory is refused, and nothing is left behind.
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        info = tarfile.TarInfo("../evil.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    data = raw.getvalue()
    cache = tmp_path / "cache"
    with pytest.raises(BundleError):
        unpack_bundle(data, sha256_of(data), cache)
    assert not (tmp_path / "evil.py").exists()
    assert list(cache.iterdir()) == []
    with pytest.raises(BundleError, match="not a valid bundle"):
        unpack_bundle(b"not gzip", sha256_of(b"not gzip"), cache)


def test_the_examples_pack_and_name_their_job_module() -> None:
    from scheduler_service.demo import example_job

    examples = Path(__file__).resolve().parents[2] / "examples"
    for name, module in (("hf_causal_lm", "lm_job.py"), ("resnet_images", "resnet_job.py")):
        spec = example_job(examples / name)
        assert spec["workload"] == f"{module.removesuffix('.py')}:job"
        bundle = pack_directory(examples / name)
        assert module in bundle.files and "job.yaml" in bundle.files
    with pytest.raises(RuntimeError, match="cannot read"):
        example_job(examples / "no-such-example")


def test_cache_keeps_under_its_cap_by_removing_the_least_recently_used(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shas = []
    for i in range(4):
        src = tmp_path / f"src{i}"
        src.mkdir()
        (src / "job.py").write_text(f"# bundle {i}\n" + "x" * 1000)
        bundle = pack_directory(src)
        path = unpack_bundle(bundle.data, bundle.sha256, cache)
        os.utime(path, (1000.0 + i, 1000.0 + i))  # used in order 0, 1, 2, 3
        shas.append(bundle.sha256)
    # Bundle 0 is used again (a cache hit marks it), so 1 is now the least recently used.
    again = pack_directory(tmp_path / "src0")
    unpack_bundle(again.data, again.sha256, cache)
    # Room for two bundles; bundle 1 is held by a running job and must stay.
    removed = prune_cache(cache, max_bytes=2 * 1020, keep={shas[1]})
    assert removed == [shas[2], shas[3]]
    assert sorted(p.name for p in cache.iterdir()) == sorted([shas[0], shas[1]])
    # Only kept bundles left and still over a tiny cap: nothing more is removed.
    assert prune_cache(cache, max_bytes=10, keep={shas[0], shas[1]}) == []
    assert prune_cache(tmp_path / "no-cache", max_bytes=10, keep=set()) == []
