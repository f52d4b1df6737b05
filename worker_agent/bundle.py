"""Workdir bundles: a job's code directory packed on the user's machine, unpacked on agents.

A bundle is a gzip-compressed tar of the directory's regular files, written deterministically
(sorted names, zero times and owners), so the same files give the same bytes and the same
SHA-256, which names the bundle everywhere: the scheduler stores it under that name, agents
cache it under it and check it before unpacking. Files matching `.gitignore`-style patterns
(the directory's own `.gitignore` and `.greenflowignore`, plus DEFAULT_EXCLUDES) are left out.

Neither side imports anything from the bundle: the scheduler stores bytes; the job's worker
processes put the unpacked directory on `sys.path` and import the job module from it.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

from worker_agent.protocol import SHA256_PATTERN

__all__ = [
    "SHA256_PATTERN",
    "Bundle",
    "BundleError",
    "pack_directory",
    "prune_cache",
    "unpack_bundle",
]

DEFAULT_EXCLUDES: tuple[str, ...] = (
    ".git/",
    ".hg/",
    "__pycache__/",
    "*.py[cod]",
    ".venv/",
    "venv/",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ruff_cache/",
    "*.egg-info/",
    ".DS_Store",
)
IGNORE_FILES: tuple[str, ...] = (".gitignore", ".greenflowignore")

MAX_BUNDLE_BYTES = 20 << 20
"""Default cap on a packed bundle (compressed)."""
MAX_UNPACKED_BYTES = 256 << 20
"""Cap on the files of a bundle before compression (and when unpacking)."""
MAX_FILES = 10_000
DEFAULT_CACHE_MAX_BYTES = 2 << 30
"""Default cap on an agent's cache of unpacked bundles."""


class BundleError(ValueError):
    """A directory cannot be packed, or bytes are not a valid bundle."""


@dataclass(frozen=True)
class Bundle:
    """A packed directory: the archive, its SHA-256 and what went in."""

    data: bytes
    sha256: str
    files: list[str]
    unpacked_bytes: int
    skipped: list[str] = field(default_factory=list)
    """Paths that are neither regular files nor directories (links, sockets): not packed."""


def sha256_of(data: bytes) -> str:
    """Hex SHA-256 of `data` (a bundle's name)."""
    return hashlib.sha256(data).hexdigest()


def _ignore_spec(root: Path) -> pathspec.PathSpec:
    lines = list(DEFAULT_EXCLUDES)
    for name in IGNORE_FILES:
        path = root / name
        if path.is_file():
            lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _selected(root: Path, spec: pathspec.PathSpec) -> tuple[list[str], list[str]]:
    files: list[str] = []
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        kept_dirs = []
        for d in sorted(dirnames):
            rel = (rel_dir / d).as_posix()
            if Path(dirpath, d).is_symlink():
                skipped.append(rel)
            elif not spec.match_file(rel + "/"):
                kept_dirs.append(d)
        dirnames[:] = kept_dirs  # don't descend into excluded directories
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if spec.match_file(rel):
                continue
            full = Path(dirpath, name)
            if full.is_symlink() or not full.is_file():
                skipped.append(rel)
                continue
            files.append(rel)
    return sorted(files), sorted(skipped)


def pack_directory(
    root: Path,
    max_bytes: int = MAX_BUNDLE_BYTES,
    max_unpacked_bytes: int = MAX_UNPACKED_BYTES,
) -> Bundle:
    """Pack `root` into a deterministic .tar.gz bundle, leaving out ignored files."""
    root = Path(root)
    if not root.is_dir():
        raise BundleError(f"{root}: not a directory")
    files, skipped = _selected(root, _ignore_spec(root))
    if not files:
        raise BundleError(f"{root}: no files to pack (all excluded?)")
    if len(files) > MAX_FILES:
        raise BundleError(f"{root}: {len(files)} files; a bundle holds at most {MAX_FILES}")
    total = sum((root / f).stat().st_size for f in files)
    if total > max_unpacked_bytes:
        raise BundleError(
            f"{root}: {total} bytes of files, over the {max_unpacked_bytes}-byte limit; "
            "exclude data and outputs in .greenflowignore"
        )
    raw = io.BytesIO()
    # mtime=0 in the gzip header and in every member: the same files give the same bytes.
    with (
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel in files:
            full = root / rel
            info = tarfile.TarInfo(rel)
            info.size = full.stat().st_size
            info.mode = 0o755 if os.access(full, os.X_OK) else 0o644
            info.mtime = 0
            with full.open("rb") as fh:
                tar.addfile(info, fh)
    data = raw.getvalue()
    if len(data) > max_bytes:
        raise BundleError(
            f"{root}: the bundle is {len(data)} bytes, over the {max_bytes}-byte limit; "
            "exclude data and outputs in .greenflowignore"
        )
    return Bundle(data, sha256_of(data), files, total, skipped)


def unpack_bundle(
    data: bytes,
    expected_sha256: str,
    cache_dir: Path,
    max_unpacked_bytes: int = MAX_UNPACKED_BYTES,
) -> Path:
    """Check `data` against its name and unpack it to `cache_dir/<sha256>` (kept if there)."""
    actual = sha256_of(data)
    if actual != expected_sha256:
        raise BundleError(f"bundle {expected_sha256[:12]}: content hashes to {actual[:12]}")
    dest = cache_dir / expected_sha256
    if dest.is_dir():
        mark_used(dest)
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Unpack beside the destination and rename: a half-written bundle is never taken as cached.
    work = Path(tempfile.mkdtemp(prefix=f".{expected_sha256[:12]}-", dir=cache_dir))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            if len(members) > MAX_FILES:
                raise BundleError(f"bundle holds {len(members)} entries, over {MAX_FILES}")
            if sum(m.size for m in members) > max_unpacked_bytes:
                raise BundleError(f"bundle unpacks to more than {max_unpacked_bytes} bytes")
            for m in members:
                if not m.isfile():
                    raise BundleError(f"bundle entry {m.name!r} is not a regular file")
            # The "data" filter refuses absolute paths, '..' and links out of the directory.
            tar.extractall(work, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise BundleError(f"bundle {expected_sha256[:12]}: not a valid bundle: {exc}") from exc
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    try:
        work.rename(dest)
    except OSError:
        # Another fetch of the same bundle got there first: theirs is the same content.
        shutil.rmtree(work, ignore_errors=True)
    return dest


def mark_used(path: Path) -> None:
    """Record that a cached bundle was used now (its directory's mtime orders evictions)."""
    with contextlib.suppress(OSError):  # gone meanwhile: the next use fetches it again
        os.utime(path)


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def prune_cache(cache_dir: Path, max_bytes: int, keep: set[str]) -> list[str]:
    """Remove the least recently used unpacked bundles until the cache holds at most
    `max_bytes`, never one named in `keep` (the bundles of jobs this agent holds); returns the
    SHA-256 of each removed. A cache of only kept bundles may stay over the cap."""
    try:
        entries = [p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    sizes = {p: _tree_bytes(p) for p in entries}
    total = sum(sizes.values())
    removed: list[str] = []
    for path in sorted(entries, key=lambda p: p.stat().st_mtime):
        if total <= max_bytes:
            break
        if path.name in keep:
            continue
        # Renamed first, so a job starting now never imports from a half-deleted directory.
        doomed = cache_dir / f".evict-{path.name}"
        try:
            path.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        total -= sizes[path]
        removed.append(path.name)
    return removed
