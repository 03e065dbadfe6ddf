"""Local disk through the OS: temp file, fsync, rename, fsync the directory.

A reader sees the old file or the new one; a crash leaves at most a temp file, which the
next writer's recovery removes, never a partial target. The version file's compare-and-swap
holds an ``flock`` (see docs/PROTOCOL.md for what that guarantees on NFS and Lustre).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import shutil
import stat
import sys
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

from asyncckpt import _liveness as liveness
from asyncckpt import _threads as workers
from asyncckpt._settings import Settings
from asyncckpt._storage.base import (
    TEMP_MARK,
    AtomicWriter,
    ReadHandle,
    Storage,
    content_tag,
    errors_as,
    first_time,
    process_lock,
    temp_name,
)
from asyncckpt.errors import ConflictError, FormatError, StorageError

log = logging.getLogger(__name__)


class LocalStorage(Storage):
    """Local disk through the OS, with fsync discipline. ``settings``: the tunables it uses
    (``lock_timeout_ms``, ``writeback_mib``), resolved by the entry point that built it;
    None: resolved now (for tools and tests)."""

    local_paths = True

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = Settings.resolve() if settings is None else settings

    def target(self, path: str) -> tuple[str, ...]:
        probe = os.path.dirname(path) or "."
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        try:
            return ("local", str(os.stat(probe).st_dev))
        except OSError:
            return ("local",)

    def on_local_disk(self, path: str) -> bool:
        """Example:
        >>> LocalStorage().on_local_disk("/proc/self/status")  # procfs is not a network fs
        True
        """
        kind = filesystem_type(path)
        return kind not in _NETWORK_FILESYSTEMS and not kind.startswith("fuse")

    def check_writable(self, path: str) -> None:
        """Refuse a directory at once, as ``torch.save`` does (a file cannot replace it).

        Raises:
            StorageError: ``path`` is a directory.
        """
        if os.path.isdir(path):
            raise StorageError(
                f"{path} is a directory: save writes one file; name a file in it, e.g. "
                f"{os.path.join(path, 'model.ackpt')}",
            )

    def open_atomic(self, path: str) -> AtomicWriter:
        return _LocalWriter(self, path)

    def size(self, path: str) -> int:
        with errors_as(self, path, "stat"):
            return os.stat(path).st_size

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with self.open_read(path) as handle:
            return handle.read_range(start, length)

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        with self.open_read(path) as handle:
            return handle.read_into(start, out)

    def open_read(self, path: str) -> ReadHandle:
        """One descriptor for the handle's life: a file renamed over ``path`` meanwhile (an
        atomic save) leaves the version it opened readable, as ``torch.load`` reads it."""
        return _LocalHandle(self, path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def delete(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        # Write a complete temp file, then hard-link it to the target: link() fails if the
        # target exists, so the target appears whole, once, or not at all.
        writer = _LocalWriter(self, path)
        try:
            writer.write(data)
            with errors_as(self, path, "create"):
                os.fsync(writer.file.fileno())
                writer.file.close()
                try:
                    os.link(writer.temp, path)
                except FileExistsError:
                    raise ConflictError(f"{path} already exists") from None
                fsync_dir(os.path.dirname(path) or ".")
        finally:
            writer.abort()

    def list_dir(self, path: str) -> list[str]:
        with errors_as(self, path, "list"):
            try:
                return sorted(os.listdir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def delete_tree(self, path: str) -> None:
        with errors_as(self, path, "delete"), contextlib.suppress(FileNotFoundError):
            if os.path.islink(path):
                os.unlink(path)  # the link only: never what it points to
            else:
                shutil.rmtree(path)  # unlinks links below it, never follows them
            fsync_dir(os.path.dirname(path) or ".")

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def read_marker(self, path: str, limit: int) -> bytes | None:
        # O_NONBLOCK: a FIFO planted where a marker goes must not hang a load in open().
        with errors_as(self, path, "read"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StorageError(
                        f"{self.describe(path)}: read failed: the save marker is not a plain "
                        "file (a special file was put there); delete it"
                    )
                data = os.pread(fd, limit + 1, 0)
            finally:
                os.close(fd)
        if len(data) > limit:
            raise FormatError(f"{path}: larger than {limit} bytes")
        return data

    def write_marker(self, path: str, data: bytes, replacing: str | None = None) -> str:
        if replacing is not None:
            self._check_marker_tag(path, replacing)
        elif _create_whole(path, data):
            return content_tag(data)
        # Written over the old bytes, then cut to length: never truncated to zero first,
        # which ext4 (auto_da_alloc) answers with a flush on close (~1 ms, not 10 us). A
        # reader in between sees new bytes followed by old ones: not JSON, so "rewriting".
        # The marker sits beside a file a user names, in a directory others may write to:
        # never follow a link planted there (O_NOFOLLOW: ELOOP), never block on a FIFO
        # (O_NONBLOCK: ENXIO), never write into anything but a plain file of one name.
        flags = os.O_WRONLY | os.O_CREAT
        for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC"):  # POSIX; absent on Windows
            flags |= getattr(os, name, 0)
        with errors_as(self, path, "write"):
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:  # the first file of a new directory
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                fd = os.open(path, flags, 0o644)
            try:
                found = os.fstat(fd)
                if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
                    raise StorageError(
                        f"{self.describe(path)}: write failed: the save marker is not a plain "
                        "file of one name (a link or a special file was put there); delete it"
                    )
                view, at = memoryview(data), 0
                while at < len(view):
                    at += os.pwrite(fd, view[at:], at)
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
        return content_tag(data)

    def abort_unfinished(self, path: str, *, exact: bool = False) -> None:
        """With ``exact``: remove the temp files of writes of ``path`` whose writer is dead.

        A writer holds an ``flock`` on its temp file until its rename (:class:`_LocalWriter`)
        and the kernel drops it when the writer dies, SIGKILL included: a temp file this
        process can lock is provably abandoned; one still locked (a live writer, or a forked
        child holding the descriptor) is left. Directory sweeps (without ``exact``) are the
        writer lease's recovery's.
        """
        import fcntl

        if not exact:
            return
        directory, prefix = os.path.dirname(path) or ".", os.path.basename(path) + TEMP_MARK
        with errors_as(self, path, "list"):
            names = [n for n in os.listdir(directory) if n.startswith(prefix)]
        for name in names:
            temp = os.path.join(directory, name)
            try:
                fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # gone (renamed by its writer, or removed), or not ours to open
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                found, named = os.fstat(fd), os.lstat(temp)
                if stat.S_ISREG(found.st_mode) and os.path.samestat(found, named):
                    os.unlink(temp)  # while locked: its writer cannot be alive
                    log.info("removed %s, left by a write that was killed", temp)
            except OSError:
                pass  # alive, or cannot tell: left
            finally:
                os.close(fd)

    def marker_lock(self, path: str) -> AbstractContextManager[None]:
        return _directory_locked(self, path)

    def replace_if(self, path: str, data: bytes, tag: str | None) -> str:
        # The lock file excludes every process that uses this protocol on this machine (and
        # on NFS/Lustre only where flock is coherent across clients; see docs/PROTOCOL.md).
        with errors_as(self, path, "lock"):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with _flocked(self, f"{path}.lock"):
            self._check_tag(path, tag)
            self._write_under_lock(path, data)
        return content_tag(data)


class _LocalHandle(ReadHandle):
    """A file open for reading by descriptor, read with ``pread``/``preadv`` (thread-safe:
    no shared file position)."""

    def __init__(self, storage: LocalStorage, path: str) -> None:
        self.storage, self.path = storage, path
        with errors_as(storage, path, "open"):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            with errors_as(storage, path, "stat"):
                size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        super().__init__(storage.describe(path), size)
        self.fd = fd
        # A handle dropped without close() (a caller that kept only the manifest) still
        # gives its descriptor back when it is collected.
        self._closer = weakref.finalize(self, os.close, fd)

    def read_range(self, start: int, length: int) -> bytes:
        parts: list[bytes] = []
        with errors_as(self.storage, self.path, "read"):
            while length > 0:
                part = os.pread(self.fd, length, start)
                if not part:
                    break
                parts.append(part)
                start, length = start + len(part), length - len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, start: int, out: memoryview) -> int:
        done = 0
        with errors_as(self.storage, self.path, "read"):
            while done < len(out):
                n = os.preadv(self.fd, [out[done:]], start + done)
                if n == 0:
                    break
                done += n
        return done

    def close(self) -> None:
        self._closer()


@contextlib.contextmanager
def _flocked(storage: LocalStorage, lock_path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``, waiting at most ``lock_timeout_ms``.

    Bounded so that a writer frozen while holding the lock (SIGSTOP, a swapped-out VM)
    turns into a clear error instead of a hang; the lock is only held for a read and an
    atomic rename, so a healthy holder never comes near the limit.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    # Closing the descriptor releases the lock; a forked child never shares it (fork hook).
    with contextlib.ExitStack() as stack:
        with errors_as(storage, lock_path, "lock"):
            fd = stack.enter_context(
                workers.lock_descriptor(lambda: os.open(lock_path, flags, 0o644))
            )
        _flock(fd, lock_path, storage.settings.lock_timeout_ms)
        yield


def _flock(fd: int, what: str, timeout_ms: int) -> None:
    """Take an exclusive ``flock`` on ``fd``, waiting at most ``timeout_ms``
    (``lock_timeout_ms``; 1 ms doubling to 50 ms between tries: :func:`liveness.poll`).

    Raises:
        StorageError: still locked by another holder after the timeout, or flock failed.
    """
    import fcntl

    def locked() -> bool | None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise StorageError(f"{what}: flock failed: {exc}") from exc
            return None

    def expired(waited: float) -> StorageError:
        return StorageError(
            f"{what}: still locked by another process after {timeout_ms} ms (a writer frozen "
            "while committing?)"
        )

    liveness.poll(locked, timeout=timeout_ms / 1000, expired=expired, first=0.001, cap=0.05)


#: flock errors that mean "not supported here" (NFS emulates flock with POSIX locks, which
#: a directory opened read-only cannot take), not "held by someone else".
_FLOCK_UNSUPPORTED = frozenset({errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL})
_warned_no_dir_lock: set[str] = set()


@contextlib.contextmanager
def _directory_locked(storage: LocalStorage, path: str) -> Iterator[None]:
    """An ``flock`` on the directory of ``path`` (the directory is created if need be).

    Where a directory cannot be flocked (some NFS mounts), a lock of this process instead,
    with one warning per directory: exclusion between processes is then lost (see
    docs/PROTOCOL.md, "Drop-in save and load across processes").
    """
    import fcntl

    directory = os.path.dirname(path) or "."
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC

    def open_directory() -> int:
        try:
            return os.open(directory, flags)
        except FileNotFoundError:  # the first save into a new directory
            os.makedirs(directory, exist_ok=True)
            return os.open(directory, flags)

    # Closing the descriptor releases the lock; a forked child never shares it (fork hook).
    with contextlib.ExitStack() as stack:
        with errors_as(storage, path, "lock"):
            fd = stack.enter_context(workers.lock_descriptor(open_directory))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _FLOCK_UNSUPPORTED:
                if first_time(_warned_no_dir_lock, directory):
                    log.warning(
                        "%s: cannot flock the directory (%s); save markers there are "
                        "exclusive only within this process (docs/PROTOCOL.md)",
                        directory,
                        exc.strerror or exc,
                    )
                with process_lock(storage, path):
                    yield
                return
            _flock(fd, directory, storage.settings.lock_timeout_ms)
        yield


def _create_whole(path: str, data: bytes) -> bool:
    """Create file ``path`` holding ``data`` in one step, where Linux can: an unnamed file
    (``O_TMPFILE``), written, then linked in. A writer killed before the link leaves
    nothing; one that created the name first and was killed before writing left an empty
    marker, which names no writer for a load to judge. False (nothing done) where ``path``
    exists (a link, too: never followed) or the filesystem cannot do this."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if not tmpfile:
        return False
    try:
        fd = os.open(os.path.dirname(path) or ".", tmpfile | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    except OSError:
        return False  # no such directory yet, or no O_TMPFILE here
    try:
        view, at = memoryview(data), 0
        while at < len(view):
            at += os.write(fd, view[at:])
        os.link(f"/proc/self/fd/{fd}", path)  # EEXIST if anything is there, a link included
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class _LocalWriter(AtomicWriter):
    def __init__(self, storage: LocalStorage, target: str) -> None:
        self.storage = storage
        self.target = target
        self.temp = temp_name(target)
        # Bytes written, and how many of them the kernel was asked to write back already.
        self.written = self.handed_over = 0
        self.writeback_bytes = storage.settings.writeback_mib << 20  # a save sets its own
        with errors_as(storage, target, "create"):
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            self.file: BinaryIO = self._open_locked_temp()

    def _open_locked_temp(self) -> BinaryIO:
        """Create the temp file and hold an ``flock`` on it until it is renamed or removed:
        the proof of life that lets the next write of the target remove the temp files of
        writers that died (:meth:`LocalStorage.abort_unfinished`), and only those."""
        import fcntl

        while True:
            file = open(self.temp, "xb", buffering=0)  # noqa: SIM115
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _FLOCK_UNSUPPORTED:
                    return file  # no flock here: sweeps cannot lock it either, and leave it
            else:
                if os.fstat(file.fileno()).st_nlink > 0:
                    return file
            # A sweep locked it in the instant between (it removes it), or locked and
            # removed it before this lock: start again.
            file.close()
            self.temp = temp_name(self.target)

    def write(self, data: bytes | memoryview) -> None:
        with errors_as(self.storage, self.temp, "write"):
            view = memoryview(data)
            self.written += view.nbytes
            while view:
                n = self.file.write(view)
                view = view[n or 0 :]
            if self.writeback_bytes and self.written - self.handed_over >= self.writeback_bytes:
                self._hand_over()

    def _hand_over(self) -> None:
        """Start writing back what was written since the last call, without waiting.

        Without it the kernel starts only at ``dirty_background_ratio`` (GiBs on a large
        host), so a checkpoint's bytes all reach the disk inside the final fsync, in series
        with the encoding; started as they are written, the disk works while later chunks
        are encoded and the fsync finds little left to do.
        """
        length = self.written - self.handed_over
        if not start_writeback(self.file.fileno(), self.handed_over, length):
            self.writeback_bytes = 0  # not supported here: leave it all to the fsync
        self.handed_over = self.written

    def commit(self) -> None:
        try:
            with errors_as(self.storage, self.target, "commit"):
                os.fsync(self.file.fileno())
                with self.publishing():
                    os.replace(self.temp, self.target)
                self.file.close()  # only now: the lock proves the temp file alive until renamed
                fsync_dir(os.path.dirname(self.target) or ".")
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.remove(self.temp)


#: ``sync_file_range`` flag: start writeback of the range's dirty pages, do not wait.
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def start_writeback(fd: int, start: int, length: int) -> bool:
    """Ask the kernel to start writing ``length`` bytes at ``start`` of ``fd`` to its device;
    False where this system or filesystem cannot do it (nothing was done).

    It does not wait for the disk and makes nothing durable: only an fsync does that. It
    may wait while the device's request queue is full, which paces a writer to its disk.

    Raises:
        OSError: the kernel reported an I/O error for the file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(bytes(4096))
        ...     f.flush()
        ...     start_writeback(f.fileno(), 0, 4096) in (True, False)
        True
    """
    call = _sync_file_range()
    if call is None:
        return False
    if call(fd, start, length, _SYNC_FILE_RANGE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err))


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Filesystems whose bytes travel over a network: compressing them pays like on S3.
_NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "9p",
        "afs",
        "ocfs2",
        "gfs2",
        "panfs",
        "wekafs",
    }
)


def filesystem_type(path: str) -> str:
    """The type of the filesystem mounted at the longest mount point above ``path`` (Linux;
    ``""`` where ``/proc/self/mounts`` cannot say)."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return ""
    full = os.path.realpath(os.path.abspath(path))
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = full == point or full.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind
