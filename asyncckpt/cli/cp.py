"""``asyncckpt cp SRC[@STEP] DST``: copy committed versions between stores in commit order.

Each version is copied as the protocol writes one (docs/PROTOCOL.md §1): its data files,
each an atomic write verified at DST, then its ``COMMIT`` (an exclusive create), then the
version file, moved forward only (compare-and-swap). So a reader of DST never sees a
committed version whose data is missing or unverified, whenever the copy stops, where a
file-by-file sync (``aws s3 sync``) may publish a ``COMMIT`` before the data it names. A
version already committed at DST with the same files is skipped, so a rerun completes an
interrupted copy. DST must not be written by a job meanwhile (``cp`` takes no writer lease).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from asyncckpt._settings import Settings
from asyncckpt._storage import Storage, resolve
from asyncckpt._versions.paths import check_root
from asyncckpt._versions.protocol import (
    CommitRecord,
    VersionRecord,
    committed_steps,
    create_commit,
    publish_version,
    read_commit,
    read_commit_strict,
    read_version_tagged,
    step_dir,
    verify_commit,
)
from asyncckpt.cli.common import (
    EXIT_OK,
    CommandFailed,
    FileRef,
    RootRef,
    UsageError,
    chosen_step,
    display,
    emit,
    locate,
    plural,
    progress,
)
from asyncckpt.cli.progress import format_bytes
from asyncckpt.cli.verify import verify_file
from asyncckpt.errors import AsyncCkptError, ConflictError, FormatError

#: Bytes read from SRC per request.
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Copied:
    """What ``cp`` did with one version: ``"copied"`` or ``"present"`` (already committed
    at DST with the same files), and the bytes it wrote."""

    step: int
    action: str
    nbytes: int = 0


def copy_versions(
    src: RootRef,
    dst: Storage,
    dst_root: str,
    settings: Settings,
    steps: list[int] | None = None,
    meter: Callable[[int], None] | None = None,
) -> list[Copied]:
    """Copy committed versions ``steps`` (default: every committed one) of ``src`` to root
    ``dst_root`` of ``dst``, oldest first (see the module); one :class:`Copied` each.

    Raises:
        CheckpointNotFoundError: nothing is committed under SRC.
        ConflictError: a step is committed at DST with other files than at SRC.
        FormatError: a copy does not verify at DST (SRC is damaged, or the copy was); its
            ``COMMIT`` was not written.
        StorageError: a backend failed; what was committed at DST stays sound.

    Example:
        >>> import torch, asyncckpt
        >>> from asyncckpt._storage import resolve
        >>> with asyncckpt.Checkpointer("memory://cp-doc/src") as ckpt:
        ...     _ = ckpt.save(7, {"w": torch.ones(2)}).result()
        >>> src = RootRef(*resolve("memory://cp-doc/src", None))
        >>> dst, dst_root = resolve("memory://cp-doc/dst", None)
        >>> [c.action for c in copy_versions(src, dst, dst_root, Settings())]
        ['copied']
    """
    storage = src.storage
    chosen = committed_steps(storage, src.path) if steps is None else steps
    if not chosen:
        chosen = [chosen_step(src)]  # raises: nothing is committed
    done = []
    for step in chosen:
        commit = read_commit(storage, src.path, step)
        if commit is None:
            chosen_step(RootRef(storage, src.path, step))  # raises, naming the committed
            continue
        done.append(_copy_version(src, commit, dst, dst_root, settings, meter or (lambda n: None)))
        _publish(dst, dst_root, commit)
    return done


def _copy_version(
    src: RootRef,
    commit: CommitRecord,
    dst: Storage,
    dst_root: str,
    settings: Settings,
    meter: Callable[[int], None],
) -> Copied:
    """Data, each verified at DST, then ``COMMIT``; or nothing, if DST has the version."""
    step = commit.step
    if _committed_at(dst, dst_root, commit):
        return Copied(step, "present")
    nbytes = 0
    for name in commit.files:
        source = src.storage.join(step_dir(src.storage, src.path, step), name)
        target = dst.join(step_dir(dst, dst_root, step), name)
        nbytes += _copy_file(src.storage, source, dst, target, meter)
        _check_copy(src.storage, source, dst, target, commit, name, settings)
    try:
        create_commit(dst, dst_root, commit)
    except ConflictError:
        if not _committed_at(dst, dst_root, commit):  # another copy committed it meanwhile
            raise
    return Copied(step, "copied", nbytes)


def _committed_at(dst: Storage, root: str, commit: CommitRecord) -> bool:
    """Whether ``commit``'s version is committed at DST, whole, with the same files; a
    ConflictError if with other files (another run's version), a FormatError if damaged."""
    there = read_commit_strict(dst, root, commit.step)
    if there is None:
        return False
    where = display(dst, step_dir(dst, root, commit.step))
    if (there.files, there.sizes, there.kind) != (commit.files, commit.sizes, commit.kind):
        raise ConflictError(
            f"step {commit.step} is committed at {where} with other files than at the source "
            f"({', '.join(there.files)}); copy to another root, or delete that version first"
        )
    problem = verify_commit(dst, root, there)
    if problem is not None:
        raise FormatError(f"step {commit.step} is committed at {where} but damaged: {problem}")
    return True


def _copy_file(
    src: Storage, source: str, dst: Storage, target: str, meter: Callable[[int], None]
) -> int:
    """Stream ``source`` into an atomic write of ``target``; the bytes copied."""
    size = src.size(source)
    with dst.atomic_write(target) as out:
        for start in range(0, size, _BLOCK):
            data = src.read_range(source, start, min(_BLOCK, size - start))
            out.write(data)
            meter(len(data))
    return size


def _check_copy(
    src: Storage,
    source: str,
    dst: Storage,
    target: str,
    commit: CommitRecord,
    name: str,
    settings: Settings,
) -> None:
    """Read the copy back at DST: a data file must verify whole, anything else (a sharded
    version's metadata) must be the source's bytes; each must have the recorded size
    (else FormatError)."""
    where = display(dst, target)
    size = dst.size(target)
    recorded = commit.sizes[commit.files.index(name)] if commit.sizes else size
    if size != recorded:
        raise FormatError(f"{where}: {size} bytes copied, the COMMIT records {recorded}")
    if name.endswith(".ackpt"):
        report = verify_file(dst, target, settings=settings)
        if not report.ok:
            bad = [f"chunk {b.chunk}: {b.detail}" for b in report.bad_chunks]
            raise FormatError(
                f"step {commit.step}: the copy {where} does not verify ("
                + "; ".join((report.errors + bad)[:3])
                + "); nothing of this version is committed at DST"
            )
    elif dst.read_bytes(target, size) != src.read_bytes(source, size):
        raise FormatError(f"step {commit.step}: the copy {where} differs from the source")


def _publish(dst: Storage, root: str, commit: CommitRecord) -> None:
    """Move DST's version file forward to ``commit``'s step (never back): a CAS on the
    value read, keeping the writer and epoch it names (a Checkpointer that opens DST later
    takes the next epoch)."""
    record, tag = read_version_tagged(dst, root)
    if record is not None and record.step is not None and record.step >= commit.step:
        return
    writer, epoch = (record.writer, record.epoch) if record else (commit.writer, commit.epoch)
    publish_version(dst, root, VersionRecord(commit.step, writer, epoch), tag)


def cmd_cp(args: argparse.Namespace) -> int:
    """``asyncckpt cp SRC[@STEP] DST``; CommandFailed when a version could not be copied
    (those before it are at DST)."""
    ref = locate(args.src, args.options, settings=args.settings)
    if isinstance(ref, FileRef):
        raise UsageError(
            f"asyncckpt cp: {args.src} is a file; cp copies the versions of a checkpoint root "
            f"(for a file: asyncckpt convert {args.src} DST.ackpt)"
        )
    dst, dst_root = resolve(args.dst, args.options, args.settings)
    check_root(dst, dst_root)  # a file: refused before anything is read
    steps = [chosen_step(ref)] if ref.step is not None else committed_steps(ref.storage, ref.path)
    if not steps:
        chosen_step(ref)  # raises: nothing is committed under SRC
    commits = [read_commit(ref.storage, ref.path, step) for step in steps]
    total = sum(sum(c.sizes) for c in commits if c is not None)
    results: list[Copied] = []
    try:
        with progress(args, total, "cp") as bar:
            for step in steps:
                results += copy_versions(ref, dst, dst_root, args.settings, [step], bar.update)
    except AsyncCkptError as exc:
        _report(args, ref, args.dst, results)
        failed = steps[len(results)]
        raise CommandFailed(f"cp: step {failed}: {exc}") from exc
    _report(args, ref, args.dst, results)
    return EXIT_OK


def _report(args: argparse.Namespace, ref: RootRef, dst: str, results: list[Copied]) -> None:
    copied = [r for r in results if r.action == "copied"]
    nbytes = sum(r.nbytes for r in copied)
    lines = [
        f"{r.step}: {'copied, verified, committed' if r.action == 'copied' else 'already there'}"
        for r in results
    ]
    lines.append(
        f"{ref.name} -> {dst}: {plural(len(copied), 'version')} copied "
        f"({format_bytes(nbytes)}), {len(results) - len(copied)} already there"
    )
    doc = {"src": ref.name, "dst": dst, "versions": [vars(r) for r in results]}
    emit(args, doc, lines)
