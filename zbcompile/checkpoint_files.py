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
storage_data, file / offset / length); `data_problems` re-reads them, so a flipped byte, a truncated or missing
file is named with the tensor it damages. MANIFEST also holds the JSON values saved with the checkpoint
(`extra`: a training loop's step) and, since format 2, a SHA-256 of its own content ("checksum", over the
canonical JSON of every other field), so an edited step or a damaged manifest is refused like a damaged tensor.
Formats read: 2 (written now) and 1 (written before the manifest checksummed itself: it loads, its tensors and
index verified, its `extra` values not). A checkpoint without MANIFEST (written by torch.distributed.checkpoint
itself) loads unverified; one that `save` wrote (its index holds the item MARKER) and that lost its MANIFEST is
damaged, as deleting one file must not turn every check off.

The commit replaces the directory at <dir> whole, so a save refuses a <dir> that holds anything but a
checkpoint's own files (`target_problem`): a user's directory of logs or notes is never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

__all__ = ["MANIFEST", "MARKER", "staging", "previous", "recover", "clear", "exists", "target_problem",
           "item_checksums", "write_manifest", "commit", "extra", "metadata_problems", "data_problems"]

MANIFEST = "zbcompile-manifest.json"
METADATA = ".metadata"   # DCP's index of the checkpoint
# an item every `save` writes into DCP's index (its value: FORMAT), so that a lost MANIFEST is seen as damage
MARKER = ("zbcompile", "format")
_OWN = (METADATA, MANIFEST, MANIFEST + ".tmp")   # with DCP's *.distcp: what a checkpoint directory holds
FORMAT = 2               # the manifest's format: 2 checksums the manifest itself (extra included); 1 does not
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


def target_problem(path: Path) -> str | None:
    """Why a save must not commit to `path`, None where it may: a new path, an empty directory, or a checkpoint
    directory holding only a checkpoint's files (the commit replaces the directory whole: anything else in it
    would be deleted)."""
    where = repr(os.fspath(path))
    if path.name in ("", ".", ".."):
        return f"{where} names no directory of its own: give the checkpoint a directory, e.g. 'checkpoints/step100'"
    if path.is_symlink():
        return f"{where} is a symbolic link: give the directory it points to"
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{where} is a file, not a checkpoint directory: give a new or empty directory"
    foreign = sorted(f.name for f in path.iterdir() if f.name not in _OWN and f.suffix != ".distcp")
    if not foreign:
        return None
    listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    what = "a checkpoint directory that also holds" if exists(path) else "a directory that is not a checkpoint, holding"
    return (f"{where} is {what} {listed}: a save replaces the whole directory, which would delete them; save into "
            "a new or empty directory")


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


def write_manifest(path: Path, items: dict[str, list], extra: dict | None = None,
                   stateless: list[str] | None = None) -> None:
    """The manifest: the checksums of the index, the files and every item, `extra`, and `stateless` (the
    parameters the optimizer had no state for yet, whose saved state is the one torch made to save it)."""
    files = {f: (path / f).stat().st_size for f, *_ in items.values()}
    body = {"format": FORMAT, "metadata": _sha(path / METADATA), "files": files,
            "items": dict(sorted(items.items())), "extra": extra or {}}
    if stateless:
        body["stateless"] = list(stateless)
    body = json.loads(json.dumps(body))   # as load parses it (tuples as lists, keys as strings): what is summed
    body["checksum"] = _digest(body)
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(body, fh, indent=0)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path / MANIFEST)


def _digest(body: dict) -> str:
    """SHA-256 of the manifest's fields but "checksum", as canonical JSON (sorted keys, no spaces): independent of
    how the file is laid out, so only a change of a value fails it."""
    fields = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    ValueError, saying what is wrong, where it cannot be read, is not what `write_manifest` writes, or its
    content differs from its checksum (required from format 2 on). Every reader goes through here, so the rest
    may trust its shape."""
    f = path / MANIFEST
    if not f.exists():
        return None
    try:
        body = json.loads(f.read_text())
    except (OSError, ValueError) as exc:   # ValueError: not JSON, or not UTF-8
        raise ValueError(f"{MANIFEST} cannot be read ({type(exc).__name__}: {exc})") from exc
    problem = _shape_problem(body)
    if problem:
        raise ValueError(f"{MANIFEST} is malformed ({problem})")
    # checked wherever there is one, whatever "format" says: a damaged "format" must not turn the check off
    if "checksum" in body and _digest(body) != body["checksum"]:
        raise ValueError(f"{MANIFEST} differs from its checksum (edited or corrupted after the save: its saved "
                         "values, such as the step, cannot be trusted)")
    return body


def _shape_problem(body) -> str | None:
    """What makes `body` other than a manifest `write_manifest` writes (the first thing found), None if nothing."""
    if not isinstance(body, dict):
        return f"a JSON {type(body).__name__}, not an object"
    if type(body.get("format")) is not int or body["format"] not in (1, 2):
        return f"format {body.get('format')!r}, where this zbcompile reads 1 and 2: a newer one wrote it, or damage"
    fields = {"metadata": str, "files": dict, "items": dict, "extra": dict} | (
        {"checksum": str} if body["format"] >= 2 or "checksum" in body else {})
    for key, kind in fields.items():
        if key not in body:
            return f'"{key}" is missing'
        if not isinstance(body[key], kind):
            return f'"{key}" is a {type(body[key]).__name__}, not a {"string" if kind is str else "JSON object"}'
    size = next((f for f, n in body["files"].items() if not _count(n)), None)
    if size is not None:
        return f'"files": {size!r} has no byte count'
    item = next((k for k, v in body["items"].items() if not _item(v, body["files"])), None)
    if item is not None:
        return f'"items": {item!r} is not [file of "files", offset, length, checksum]'
    return None


def _count(n) -> bool:
    return type(n) is int and n >= 0   # not a bool, which JSON's true would give


def _item(value, files: dict) -> bool:
    return (isinstance(value, list) and len(value) == 4 and isinstance(value[0], str) and value[0] in files
            and _count(value[1]) and _count(value[2]) and isinstance(value[3], str))


def extra(path: Path) -> dict:
    """The values saved with the checkpoint (`save(..., extra=)`); {} without a manifest."""
    body = _manifest(path)
    return dict(body["extra"]) if body else {}


def stateless(path: Path) -> list[str]:
    """The parameters whose optimizer had not stepped when the checkpoint was saved; [] without a manifest."""
    body = _manifest(path)
    return list(body.get("stateless", ())) if body else []


def metadata_problems(path: Path) -> list[str]:
    """What is wrong with the checkpoint's index (.metadata) and manifest; [] where they are whole."""
    try:
        body = _manifest(path)
    except ValueError as exc:
        return [f"damaged: {exc}"]
    if body is None:
        return [f"damaged: {MANIFEST} is missing, which zbcompile's save writes with every checkpoint: its data "
                "cannot be verified"] if _marked(path) else []
    if _sha(path / METADATA) != body["metadata"]:
        return [f"damaged: {METADATA} (its checksum differs from the one saved)"]
    return []


def _marked(path: Path) -> bool:
    """Whether zbcompile's save wrote the checkpoint at `path` (its index holds MARKER); False where the index
    cannot be read (the load's own read then says why)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:   # OSError, or whatever unpickling a damaged index raises
        return False
    return ".".join(MARKER) in keys


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
