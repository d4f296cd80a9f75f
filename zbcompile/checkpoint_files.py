"""The files of a checkpoint directory: staged, checksummed, committed in one step, verified before a load.

    <dir>/                          the checkpoint: DCP's files (.metadata, __<rank>_<n>.distcp) and MANIFEST
    <parent>/.<name>.staging/       a save in progress (never read; the next save clears it)
    <parent>/.<name>.previous/      the checkpoint a commit is replacing, for the instant between two renames

A save writes into the staging directory; once every rank has written its files, the ranks checksum them
(each a share of the files), rank 0 writes MANIFEST and commits: rename <dir> to .previous, rename the staging
directory to <dir>, remove .previous. Each rename is atomic, so at every moment either <dir> or .previous is a
complete checkpoint, and `recover` (run before every save and load) puts .previous back where a crash came
between the two renames. A crash before the commit leaves <dir> as it was.

MANIFEST holds a SHA-256 of .metadata and of every item's bytes (a tensor, or a pickled value: DCP's
storage_data, file / offset / length); `problems` re-reads them, so a flipped byte, a truncated or missing file
is named with the tensor it damages. A checkpoint without MANIFEST (written by torch.distributed.checkpoint
itself) loads unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

__all__ = ["MANIFEST", "staging", "previous", "recover", "clear", "exists", "item_checksums", "write_manifest",
           "commit", "extra", "metadata_problems", "data_problems"]

MANIFEST = "zbcompile-manifest.json"
METADATA = ".metadata"   # DCP's index of the checkpoint
_CHUNK = 1 << 20


def staging(path: Path) -> Path:
    return path.parent / f".{path.name}.staging"


def previous(path: Path) -> Path:
    return path.parent / f".{path.name}.previous"


def recover(path: Path) -> None:
    """Finish or undo a commit a crash interrupted (rank 0, before any save or load)."""
    prev = previous(path)
    if prev.exists():
        if path.exists():   # the new checkpoint is in place; only removing the old one was left
            shutil.rmtree(prev)
        else:               # between the two renames: the previous checkpoint goes back
            os.rename(prev, path)
            _sync_dir(path.parent)


def clear(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def exists(path: Path) -> bool:
    return (path / METADATA).is_file()


def _sha(path: Path, offset: int = 0, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = length
        while left is None or left > 0:
            block = fh.read(_CHUNK if left is None else min(_CHUNK, left))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
    return h.hexdigest()


def _items(path: Path) -> dict[str, tuple[str, int, int]]:
    """Every stored item of the checkpoint at `path`: "<key>@<offset>" -> (file, byte offset, byte length)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(path)).read_metadata().storage_data
    return {f"{index.fqn}@{list(index.offset) if index.offset is not None else ''}":
            (info.relative_path, info.offset, info.length) for index, info in storage.items()}


def item_checksums(path: Path, part: int, parts: int) -> dict[str, list]:
    """The checksums of the items in share `part` of `parts` of the files (each rank hashes a share)."""
    items = _items(path)
    files = sorted({f for f, _, _ in items.values()})[part::parts]
    return {key: [f, off, length, _sha(path / f, off, length)] for key, (f, off, length) in items.items()
            if f in files}


def write_manifest(path: Path, items: dict[str, list], extra: dict | None = None) -> None:
    files = {f: (path / f).stat().st_size for f, *_ in items.values()}
    body = {"format": 1, "metadata": _sha(path / METADATA), "files": files, "items": dict(sorted(items.items())),
            "extra": extra or {}}
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(body, fh, indent=0)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path / MANIFEST)


def commit(stage: Path, path: Path) -> None:
    """Make the staged checkpoint the one at `path` (see the module docstring for why a crash loses nothing)."""
    for f in stage.iterdir():   # what DCP wrote reaches the disk before the directory is renamed
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    prev = previous(path)
    if path.exists():
        os.rename(path, prev)
    os.rename(stage, path)
    _sync_dir(path.parent)
    if prev.exists():
        shutil.rmtree(prev)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest(path: Path) -> dict | None:
    """The manifest, None where there is none (a checkpoint torch.distributed.checkpoint wrote itself);
    ValueError where it cannot be read."""
    f = path / MANIFEST
    if not f.exists():
        return None
    try:
        body = json.loads(f.read_text())
        if body.get("format") != 1:
            raise ValueError(f"format {body.get('format')!r}")
        return body
    except (OSError, ValueError) as exc:
        raise ValueError(f"{MANIFEST} cannot be read ({type(exc).__name__}: {exc})") from exc


def extra(path: Path) -> dict:
    """The values saved with the checkpoint (`save(..., extra=)`); {} without a manifest."""
    body = _manifest(path)
    return dict(body.get("extra", {})) if body else {}


def metadata_problems(path: Path) -> list[str]:
    """What is wrong with the checkpoint's index (.metadata) and manifest; [] where they are whole."""
    try:
        body = _manifest(path)
    except ValueError as exc:
        return [f"damaged: {exc}"]
    if body is None:
        return []
    if _sha(path / METADATA) != body["metadata"]:
        return [f"damaged: {METADATA} (its checksum differs from the one saved)"]
    return []


def data_problems(path: Path, part: int, parts: int) -> list[str]:
    """What is wrong with the data files in share `part` of `parts`: missing or truncated files, items whose
    bytes changed, each named with the tensor (or value) it holds."""
    body = _manifest(path)
    if body is None:
        return []
    files = sorted(body["files"])[part::parts]
    out = []
    for f in files:
        p = path / f
        if not p.exists():
            out.append(f"damaged: file {f} is missing")
        elif p.stat().st_size != body["files"][f]:
            out.append(f"damaged: file {f} has {p.stat().st_size} bytes where {body['files'][f]} were saved")
    bad = {o.split()[2] for o in out}
    for key, (f, off, length, sha) in body["items"].items():
        if f in files and f not in bad and _sha(path / f, off, length) != sha:
            out.append(f"damaged: file {f}, {key.rpartition('@')[0]} (bytes {off}-{off + length}: checksum differs)")
    return out
