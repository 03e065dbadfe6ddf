"""Break each guarantee of docs/PROTOCOL.md with a minimal edit; check that its test fails.

For every mutation below: copy the repository's ``asyncckpt`` and ``tests`` to a temporary
directory, apply the edit there (the working tree is never touched), run the tests the
guarantee cites, and report ``caught`` (they failed), ``SURVIVED`` (they passed: the test
cannot see the guarantee break) or ``stale`` (the edit no longer applies: the code moved;
update the mutation). The cited tests are first run on the unmutated copy, which must pass.

Run outside ``make test`` (minutes)::

    python scripts/mutations.py            # every mutation
    python scripts/mutations.py -k fsync   # those whose name contains "fsync"
    python scripts/mutations.py --list     # the mutations and their tests

The exit status is 0 when every mutation is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: A mutated run that takes longer than this counts as caught only if it failed; a hang
#: is reported as such.
TIMEOUT_S = 900


@dataclass(frozen=True)
class Mutation:
    """One minimal edit that breaks one guarantee, and the tests that must then fail."""

    name: str
    guarantee: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "commit-overwrites",
        "COMMIT is created exclusively (PROTOCOL.md §0, §3 step 4)",
        "asyncckpt/_versions/protocol.py",
        "    storage.create_exclusive(path, encode_record(doc))",
        "    storage.write_bytes(path, encode_record(doc))",
        (
            "tests/versions/test_commit_order.py::"
            "test_a_commit_marker_that_appears_first_is_never_overwritten",
        ),
    ),
    Mutation(
        "no-fsync-before-rename",
        "data durable before COMMIT (§3 step 2)",
        "asyncckpt/_storage/local.py",
        "                os.fsync(self.file.fileno())\n                with self.publishing():",
        "                with self.publishing():",
        (
            "tests/versions/test_commit_order.py::"
            "test_data_is_durable_before_commit_and_commit_before_version",
        ),
    ),
    Mutation(
        "no-directory-fsync-after-rename",
        "data durable before COMMIT (§3 step 2: fsync the directory)",
        "asyncckpt/_storage/local.py",
        'alive until renamed\n                fsync_dir(os.path.dirname(self.target) or ".")',
        "alive until renamed\n",
        (
            "tests/versions/test_commit_order.py::"
            "test_data_is_durable_before_commit_and_commit_before_version",
        ),
    ),
    Mutation(
        "version-before-commit",
        "VERSION is written after COMMIT (§3 steps 4-5)",
        "asyncckpt/_versions/writing.py",
        "            self._create_commit(step, version, dict(metrics or {}))\n"
        "            self._publish(step, tag)",
        "            self._publish(step, tag)\n"
        "            self._create_commit(step, version, dict(metrics or {}))",
        (
            "tests/versions/test_commit_order.py::"
            "test_data_is_durable_before_commit_and_commit_before_version",
        ),
    ),
    Mutation(
        "version-replaced-unconditionally",
        "VERSION moves only by compare-and-swap: never backwards, never to a fenced epoch (§0)",
        "asyncckpt/_versions/protocol.py",
        "    return storage.replace_if(storage.join(root, VERSION_FILE), "
        "encode_record(asdict(record)), tag)",
        "    return storage.replace_if(storage.join(root, VERSION_FILE), "
        "encode_record(asdict(record)), read_version_tagged(storage, root)[1])",
        (
            "tests/versions/test_commit_order.py::"
            "test_a_writer_taken_over_after_its_epoch_check_cannot_move_version_back",
        ),
    ),
    Mutation(
        "dropin-load-does-not-wait",
        "a drop-in load waits for a save of the file in flight in another process (§8)",
        "asyncckpt/_versions/pending.py",
        "    if storage.process_local:\n        return\n    marker = marker_of(path)",
        "    if True:\n        return\n    marker = marker_of(path)",
        ("tests/api/test_dropin_processes.py::test_ddp_tutorial_recipe_on_two_gloo_ranks",),
    ),
    Mutation(
        "reader-repairs-lagging-version",
        "readers never write (§0)",
        "asyncckpt/_versions/protocol.py",
        "        if commit is not None and verify_commit(storage, root, commit) is None:\n"
        "            return step",
        "        if commit is not None and verify_commit(storage, root, commit) is None:\n"
        "            write_version_file(storage, root, VersionRecord(step, commit.writer, "
        "commit.epoch))\n"
        "            return step",
        ("tests/versions/test_roles.py::test_readers_change_nothing",),
    ),
    Mutation(
        "delete-data-before-commit",
        "a version is deleted COMMIT first (§2, §5)",
        "asyncckpt/_versions/protocol.py",
        "        storage.delete(storage.join(directory, COMMIT_FILE))\n"
        "    storage.delete_tree(directory)",
        "        pass\n    storage.delete_tree(directory)",
        ("tests/testing/test_crash_points.py::test_every_point_in_process",),
    ),
    Mutation(
        "epoch-check-ignored",
        "a fenced writer commits nothing (§0 fencing)",
        "asyncckpt/_versions/writing.py",
        "        if record is not None and record.epoch == self.epoch and "
        "record.writer == self.token:\n            return record, tag",
        "        if record is not None:\n            return record, tag",
        (
            "tests/versions/test_interleavings.py::test_every_actor_in_one_scripted_run",
            "tests/versions/test_interleavings.py::test_interleavings",
        ),
    ),
    Mutation(
        "retention-deletes-the-pinned-step",
        "retention never deletes the version file's step (§5)",
        "asyncckpt/_versions/retention.py",
        "    keep = policy.keeps(committed, now) | {pinned} | set(spare)\n"
        "    if good is not None:\n        keep.add(good)\n"
        "    return [e for e in entries if e.step < pinned and",
        "    keep = policy.keeps(committed, now) | set(spare)\n"
        "    if good is not None:\n        keep.add(good)\n"
        "    return [e for e in entries if e.step <= pinned and",
        ("tests/versions/test_deletion.py::test_the_deletion_rule",),
    ),
    Mutation(
        "recovery-keeps-temp-files",
        "no temp file survives the next successful save (§0 step 4)",
        "asyncckpt/_versions/writing.py",
        "        names = temp_files(self.storage, directory)\n",
        "        names: list[str] = []\n",
        ("tests/testing/test_crash_points.py::test_every_point_in_process",),
    ),
    Mutation(
        "no-checksum-verify",
        "every chunk is verified on every load (§6: never a partial or mixed version)",
        "asyncckpt/_engine/chunks.py",
        "    if checksum(stored) != chunk.crc32:",
        "    if False:",
        ("tests/format/test_corruption.py",),
    ),
)


def _copy(into: Path) -> None:
    for part in ("asyncckpt", "tests", "pyproject.toml"):
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, into / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, into / part)


def _pytest(where: Path, tests: tuple[str, ...]) -> tuple[int | None, float, str]:
    env = {**os.environ, "PYTHONPATH": str(where), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(
            cmd, cwd=where, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start, "timed out"
    tail = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, time.monotonic() - start, tail[-1] if tail else ""


def run(mutation: Mutation) -> str:
    with tempfile.TemporaryDirectory(prefix="ackpt-mut-") as tmp:
        where = Path(tmp)
        _copy(where)
        target = where / mutation.file
        text = target.read_text()
        found = text.count(mutation.old)
        if found != 1:
            return f"stale     {mutation.name}: the edit's text occurs {found} times"
        code, seconds, last = _pytest(where, mutation.tests)
        if code != 0:
            return f"baseline  {mutation.name}: the cited tests fail unmutated ({last})"
        target.write_text(text.replace(mutation.old, mutation.new))
        code, seconds, last = _pytest(where, mutation.tests)
    if code is None:
        return f"hang      {mutation.name}: the tests hung past {TIMEOUT_S} s"
    verdict = "caught   " if code != 0 else "SURVIVED "
    return f"{verdict} {mutation.name} ({seconds:.0f} s): {last}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.guarantee}\n    {m.file}\n    " + "\n    ".join(m.tests))
        return 0
    results = []
    for mutation in chosen:
        line = run(mutation)
        print(line, flush=True)
        results.append(line)
    survived = [r for r in results if not r.startswith("caught")]
    print(f"{len(results) - len(survived)} of {len(results)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
