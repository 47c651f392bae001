"""Where a run's files live: local paths and object stores (`gs://...`) through one path type,
`etils.epath.Path` (the path library Orbax and TFDS use; gcsfs, or another fsspec scheme);
guide: docs/training.md, 'Workdirs on object stores'.

Three kinds of file need a local copy, and this module gives them one. `local_copy`: files read
by libraries that open local files only (SentencePiece, `tokenizers`, safetensors), and built
datasets of formats 2-3 (ArrayRecord, whose reader over-reads an object store; format 4 is
read by byte range, bertjax.data.shards); copied once per host into `BERTJAX_CACHE` (default
~/.cache/bertjax). `LocalMirror`: files written
incrementally (metrics.jsonl, TensorBoard events, profiler traces), uploaded at each `sync()`,
since object stores cannot append. `local_output`: writers of local files only (ArrayRecord,
SentencePiece training), uploaded when done.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from etils import epath

PathLike = str | os.PathLike


def path(p: PathLike) -> epath.Path:
  """`p` as an epath.Path (local paths made absolute)."""
  if isinstance(p, str) and "://" in p:
    return epath.Path(p)
  if isinstance(p, epath.Path) and is_remote(p):
    return p
  return epath.Path(os.path.abspath(os.fspath(p)))


def is_remote(p: PathLike) -> bool:
  """Whether `p` names an object store (a URL with a scheme), not a local file."""
  return "://" in os.fspath(p)


def open_binary(p: PathLike) -> IO[bytes]:
  """`p` opened for binary reading with random access: a local file, or an object on a store
  (fsspec: a seek is a new ranged read), so a reader of byte ranges fetches only those."""
  return open(os.fspath(p), "rb") if not is_remote(p) else path(p).open("rb")


def file_size(p: PathLike) -> int:
  """The size of file `p` in bytes, local or on an object store."""
  return os.stat(os.fspath(p)).st_size if not is_remote(p) else path(p).stat().length


def cache_root() -> Path:
  return Path(os.environ.get("BERTJAX_CACHE", "~/.cache/bertjax")).expanduser()


def _copy_file(src: epath.Path, dst: Path | epath.Path) -> None:
  dst.parent.mkdir(parents=True, exist_ok=True)
  with src.open("rb") as fin, dst.open("wb") as fout:
    shutil.copyfileobj(fin, fout, 8 << 20)


def _files(root: epath.Path) -> list[epath.Path]:
  out = []
  for entry in root.iterdir():
    if entry.is_dir():
      out.extend(_files(entry))
    else:
      out.append(entry)
  return out


def copy_tree(src: PathLike, dst: PathLike, threads: int = 16) -> int:
  """Copies every file under `src` to the same relative path under `dst` (either side local or
  remote; existing files replaced), in parallel; returns the number of files."""
  src, dst = path(src), path(dst)
  files = _files(src)
  with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
    list(pool.map(lambda f: _copy_file(f, dst / os.path.relpath(os.fspath(f), os.fspath(src))),
                  files))
  return len(files)


def upload(local: PathLike, remote: PathLike) -> None:
  """A local file or directory to `remote` (a no-op when both are the same local path)."""
  local, remote = path(local), path(remote)
  if os.fspath(local) == os.fspath(remote):
    return
  if local.is_dir():
    copy_tree(local, remote)
  else:
    _copy_file(local, remote)


@contextlib.contextmanager
def local_output(out: PathLike) -> Iterator[Path]:
  """A local directory to write `out`'s contents into: `out` itself when it is local; for an
  object store a temporary directory, uploaded to `out` when the block ends without error."""
  target = path(out)
  if not is_remote(target):
    yield Path(os.fspath(target))
    return
  with tempfile.TemporaryDirectory(prefix="bertjax-output-") as scratch:
    yield Path(scratch)
    upload(scratch, target)


@contextlib.contextmanager
def host_lock(name: Path) -> Iterator[None]:
  """An exclusive lock between the processes of this host, held on the file `name` (several
  training processes per host copy a remote dataset once; the jobs of a GPU session time their
  steps one at a time)."""
  name.parent.mkdir(parents=True, exist_ok=True)
  with open(name, "w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def local_copy(p: PathLike) -> Path:
  """A local path with the contents of file or directory `p`: `p` itself when local, else a copy
  in this host's cache, made once (a marker written last says the copy is whole; the sizes of
  the remote files are checked against it on every later use)."""
  source = path(p)
  if not is_remote(source):
    return Path(os.fspath(source))
  if not source.exists():
    raise FileNotFoundError(f"{source} does not exist")
  key = hashlib.sha256(os.fspath(source).encode()).hexdigest()[:16]
  target = cache_root() / "remote" / f"{key}-{source.name}"
  files = [source] if not source.is_dir() else _files(source)
  manifest = "\n".join(f"{os.path.relpath(os.fspath(f), os.fspath(source))}\t{f.stat().length}"
                       for f in sorted(files, key=os.fspath))
  marker = target.parent / f"{target.name}.complete"
  with host_lock(target.parent / f"{target.name}.lock"):
    if not (marker.is_file() and marker.read_text() == manifest):
      if target.exists():
        shutil.rmtree(target) if target.is_dir() else target.unlink()
      if source.is_dir():
        copy_tree(source, target)
      else:
        _copy_file(source, target)
      marker.write_text(manifest)
  return target


class LocalMirror:
  """A local directory whose files are uploaded to `remote` at every `sync()`; `names` limits it
  to those top-level entries of `remote`. For a local `remote` it is that directory itself and
  `sync()` does nothing. Files already at `remote` are downloaded first, so appending
  continues a resumed run's files."""

  def __init__(self, remote: PathLike, names: tuple[str, ...] | None = None):
    self.remote = path(remote)
    self._names = names
    self._temp = None
    if not is_remote(self.remote):
      self.local = Path(os.fspath(self.remote))
      self.local.mkdir(parents=True, exist_ok=True)
      return
    self._temp = tempfile.TemporaryDirectory(prefix="bertjax-mirror-")
    self.local = Path(self._temp.name)
    for name in names or [e.name for e in self.remote.iterdir()] if self.remote.exists() else ():
      entry = self.remote / name
      if entry.is_dir():
        copy_tree(entry, self.local / name)
      elif entry.exists():
        _copy_file(entry, self.local / name)
    self._uploaded = {str(f): self._stamp(f) for f in self._local_files()}

  @staticmethod
  def _stamp(f: Path) -> tuple[int, int]:
    stat = f.stat()
    return stat.st_size, stat.st_mtime_ns

  def _local_files(self) -> list[Path]:
    return [f for f in self.local.rglob("*") if f.is_file() and (
        self._names is None or f.relative_to(self.local).parts[0] in self._names)]

  def sync(self) -> None:
    """Uploads every file changed since the last sync."""
    if self._temp is None:
      return
    for f in self._local_files():
      stamp = self._stamp(f)
      if self._uploaded.get(str(f)) != stamp:
        _copy_file(epath.Path(f), self.remote / os.fspath(f.relative_to(self.local)))
        self._uploaded[str(f)] = stamp

  def close(self) -> None:
    self.sync()
    if self._temp is not None:
      self._temp.cleanup()
      self._temp = None
