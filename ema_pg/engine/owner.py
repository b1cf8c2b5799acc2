"""Who writes a run folder: one live process at a time, by a lock the kernel keeps.

Apart from :mod:`.runs` (the folder's lifecycle) so that a process asking only this, a test racing many
processes for a folder or ``evaluate`` checking that a run is still live, imports neither torch nor the models.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ConfigError

CLAIM = ".ema_pg_run"  #: the claim file: locked (flock) by the process that writes the folder, holding its host and pid
_HELD: dict[str, int] = {}  #: the run folders this process holds: resolved path -> the claim's open descriptor


def claim_run_dir(run_dir: Path) -> Path:
    """Make ``run_dir`` this process's run folder, atomically; if another live run holds it (two runs
    started in the same second get the same Hydra folder), take ``<name>-2``, ``-3``, ... instead.

    The claim is an exclusive lock (``flock``) on the folder's claim file, held while the run lives: the kernel
    releases it when the process ends, however it ends (SIGKILL too), so a killed run's folder is free at once and
    of any number of processes reaching for it, exactly one gets it. The file holds the holder's host and pid, for
    messages; a claim written on another host (a shared file system, where the lock does not reach) is never
    taken over.
    """
    for i in range(1, 1000):
        cand = run_dir if i == 1 else run_dir.with_name(f"{run_dir.name}-{i}")
        if _try_claim(cand) is None:
            return cand
    raise RuntimeError(f"no free run folder next to {run_dir}")


def own_run_dir(run_dir: Path) -> None:
    """Make the existing ``run_dir`` this process's (a resume, a sweep's fixed folder), or refuse with one line
    naming the live process that writes there: two writers would interleave ``metrics.csv`` and checkpoints."""
    owner = _try_claim(run_dir)
    if owner is not None:
        who = f"process {owner[1]} on {owner[0]}" if len(owner) == 2 else "another process"
        raise ConfigError(f"{run_dir} is being written by a live run ({who}); wait for it to end or stop it, "
                          "then resume")


def release_run_dir(run_dir: Path) -> None:
    """Let go of a run folder this process holds (its run ended; the process may live on: a sweep, a test)."""
    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the lock


def live_owner(run_dir: Path) -> list[str] | None:
    """[host, pid] of the live process that holds ``run_dir`` (None: no claim, or its process is gone)."""
    import fcntl

    claim = Path(run_dir) / CLAIM
    if str(Path(run_dir).resolve()) in _HELD:
        return _me().split()
    try:
        owner = claim.read_text().split()
        fd = os.open(claim, os.O_RDWR)
    except OSError:
        return None
    try:
        if other_host(owner):
            return owner
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return owner or ["another", "process"]
        fcntl.flock(fd, fcntl.LOCK_UN)  # free: nobody holds it
        return None
    finally:
        os.close(fd)


def _me() -> str:
    import socket

    return f"{socket.gethostname()} {os.getpid()}"


#: set to 1 where the run folders' file system carries ``flock`` across hosts (NFSv4, Lustre mounted ``-o flock``,
#: GPFS): a claim written on another host is then judged by its lock, and a cell preempted on one node resumes on
#: another; unset, such a claim is never taken over (the lock might not reach here)
SHARED_LOCKS = "EMA_PG_SHARED_LOCKS"


def shared_locks() -> bool:
    return os.environ.get(SHARED_LOCKS) == "1"


def other_host(owner: list[str]) -> bool:
    import socket

    return len(owner) == 2 and owner[0] != socket.gethostname() and not shared_locks()


def _try_claim(folder: Path) -> list[str] | None:
    """Claim ``folder`` for this process (None), or return the claim's live owner."""
    return try_claim(folder, CLAIM)


def try_claim(folder: Path, name: str) -> list[str] | None:
    """Claim ``folder`` for this process by its claim file ``name`` (a run's, a decision plan's): None, or the
    claim's live owner ([host, pid])."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder.resolve()) if name == CLAIM else str((folder / name).resolve())
    claim = folder / name
    if key in _HELD:  # this process holds it already (a run started again in-process)
        return None
    fd = os.open(claim, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            owner = claim.read_text().split()
        except OSError:
            owner = []
        return owner or ["another", "process"]
    owner = os.pread(fd, 256, 0).decode(errors="replace").split()
    if other_host(owner):  # written on another machine: its lock is not ours to see
        os.close(fd)
        return owner
    os.ftruncate(fd, 0)  # in place: the lock is on this file, so it is never replaced
    os.pwrite(fd, _me().encode(), 0)
    _HELD[key] = fd
    return None
