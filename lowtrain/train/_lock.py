"""One run per folder: a lock file (`.lowtrain.lock`, as git's `index.lock`) that a
launch takes before it writes anything into its run folder, holding the process id,
the host and the start time of the process that holds it.

A second launch on a folder whose lock is held by a live process is refused with
one line naming that process. A lock left by a process that is gone (killed, the
machine rebooted) is taken over, with a warning that says so. A lock from another
host cannot be checked from here: it is refused, and the message says how to take
it over once that process is known to be gone.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import time

log = logging.getLogger("lowtrain")

LOCK_NAME = ".lowtrain.lock"


class RunFolderLocked(RuntimeError):
    """Another live `fit` trains in this folder (see `RunLock`): raised by
    `Trainer.fit` for its checkpoint folder, before anything is read or written.

    ```python
    import tempfile
    from lowtrain.train import RunFolderLocked, RunLock

    folder = tempfile.mkdtemp()
    with RunLock(folder):
        try:
            RunLock(folder).acquire()  # a second fit while the first runs
        except RunFolderLocked as e:
            assert "one `fit` at a time" in str(e)
    ```
    """


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class RunLock:
    """Hold `folder`'s lock from `acquire` to `release` (or as a context manager).

    ```python
    import tempfile
    from lowtrain.train import RunFolderLocked, RunLock

    folder = tempfile.mkdtemp()
    with RunLock(folder) as lock:
        assert lock.path.name == ".lowtrain.lock"  # the process id and host
        try:  # another process would be told "in use by process <pid> on <host>"
            RunLock(folder).acquire()
        except RunFolderLocked:
            pass
    RunLock(folder).acquire().release()  # released: free again
    ```
    """

    def __init__(self, folder):
        self.folder = pathlib.Path(folder)
        self.path = self.folder / LOCK_NAME
        self._held = False

    def _record(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._record(), f)
        return True

    def acquire(self) -> RunLock:
        """Take the lock, or raise `RunFolderLocked` naming the process that holds
        it; a lock of a process that is gone is taken over (a warning)."""
        if self._held:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # another launch may take over a stale lock meanwhile
            if self._create():
                self._held = True
                return self
            try:
                other = json.loads(self.path.read_text())
                pid, host = int(other["pid"]), str(other["host"])
            except FileNotFoundError:
                continue  # released just now: try again
            except (OSError, ValueError, KeyError, TypeError):
                other, pid, host = None, None, None  # damaged: nobody holds it
            if pid is not None and host == socket.gethostname():
                if pid == os.getpid():
                    raise RunFolderLocked(
                        f"Expected one `fit` at a time in {self.folder}, got a second "
                        "one in the same process while the first still runs."
                    )
                if _alive(pid):
                    raise RunFolderLocked(
                        f"{self.folder} is in use by process {pid} on {host} (since "
                        f"{time.ctime(other.get('since', 0))}): one run per folder. "
                        "Wait for it, stop it, or use another folder."
                    )
            elif pid is not None:
                raise RunFolderLocked(
                    f"{self.folder} is in use by process {pid} on host {host}, which "
                    "cannot be checked from here: one run per folder. If that process "
                    f"is gone, delete {self.path} and launch again."
                )
            gone = (
                f"process {pid} on {host}" if pid is not None else "an unreadable lock"
            )
            log.warning(
                "taking over %s: it was held by %s, which is gone", self.path, gone
            )
            self.path.unlink(missing_ok=True)
        raise RunFolderLocked(
            f"Expected to take the lock {self.path}, got it taken by another launch "
            "each time. One run per folder: use another folder."
        )

    def release(self) -> None:
        if self._held:
            self._held = False
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
