"""Files that are records: written beside their destination and renamed into place, so a reader never sees half a
file and a full disk leaves nothing behind but the previous version.

``atomic_write`` (a text or a bytes file), ``atomic_dir`` (a folder built whole, then renamed), and
:class:`AtomicCheckpointIO` (Lightning's checkpoints the same way: Lightning's own writes the whole checkpoint into
the system temp folder and moves it across file systems, which is neither atomic nor possible on a small node-local
``/tmp``). A write that finds no room raises :class:`NoRoom`, one line naming the folder and the space it needed.
``file_lock`` serializes processes that would build the same thing (a study's trials, a cold start).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import shutil
from pathlib import Path


#: the errors that mean "the disk (or a quota, or a file-size limit) has no room for this file"
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class NoRoom(OSError):
    """A record could not be written for lack of space: says where and about how much it needed."""

    def __init__(self, path: Path, needed: int | None, cause: OSError):
        need = f" (about {needed / 2**20:.1f} MiB needed)" if needed else ""
        super().__init__(cause.errno, f"no room to write {Path(path).name} in {Path(path).parent}{need}: "
                                      f"{os.strerror(cause.errno)}; free space there (or point the run elsewhere)")
        self.path, self.needed = Path(path), needed

    def __str__(self) -> str:
        return self.strerror


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, waiting=None):
    """Hold an exclusive lock on ``path`` (created, with its folder, if missing) for the ``with`` block; another
    process asking for it waits until the block ends, or until the holder dies (the kernel drops its lock).
    ``waiting()`` is called once, before blocking, when another process holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _no_room_is_one_line(path: Path, needed: int | None, tmp: Path):
    try:
        yield
    except Exception as e:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        code = no_room_errno(e)
        if code is not None:
            raise NoRoom(path, needed, OSError(code, os.strerror(code))) from None
        raise


def no_room_errno(e: BaseException) -> int | None:
    """The errno of a "no room" failure (an OSError, or a writer's own error that carries one, as safetensors'
    does in its message), else None."""
    if isinstance(e, NoRoom):
        return e.errno
    if isinstance(e, OSError) and e.errno in NO_ROOM:
        return e.errno
    text = str(e)
    return next((code for code in NO_ROOM if f"code: {code}," in text or f"[Errno {code}]" in text
                 or f"os error {code})" in text), None)


def atomic_write(path: str | os.PathLike, data: str | bytes | memoryview) -> Path:
    """Write ``data`` to ``path`` whole or not at all (a temporary file beside it, fsynced, then renamed)."""
    path = Path(path)
    tmp = _tmp(path)
    raw = data.encode() if isinstance(data, str) else data
    with _no_room_is_one_line(path, raw.nbytes if isinstance(raw, memoryview) else len(raw), tmp):
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, needed: int | None = None):
    """Yield a temporary folder beside ``path``; when the block ends without error it becomes ``path`` (an
    existing folder there is replaced). On an error the temporary folder is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = _tmp(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _no_room_is_one_line(path, needed, tmp):
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(path.parent)


def nbytes(obj) -> int:
    """The bytes of the tensors in a nested state (a lower bound of its size on disk)."""
    import torch  # here, as below: the commands that only write files (decide, track, claims) start without torch

    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def atomic_torch_save(obj, path: str | os.PathLike) -> Path:
    """``torch.save`` beside the destination, fsynced, renamed: a reader finds the old file or the new one. The
    state is serialized in memory first (as Lightning's own writer does): torch's zip writer turns a failed write
    into an error without its cause, Python's file write keeps the errno that says the disk is full."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write(path, buffer.getbuffer())


def atomic_checkpoint_io():
    """Lightning's CheckpointIO with :func:`atomic_torch_save` (built lazily: Lightning is the engine's import)."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            atomic_torch_save(checkpoint, path)

    return AtomicCheckpointIO()
