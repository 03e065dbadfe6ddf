"""The documentation cannot rot: every ```python block of the guide and the README runs.

Each block runs as a script of its own, in a fresh temporary working directory, in a
subprocess with a timeout. A block whose doc says to run it twice (the paragraph right
before or after it says "twice") runs twice in a row in the same directory (and against the
same bucket): a user runs the example again, a job restarts, and the second run meets what
the first one left (a committed step, an existing file). The first line of a block may say
how to run it:

- ``# run: torchrun --nproc_per_node=N`` runs it under ``python -m torch.distributed.run
  --standalone --nproc_per_node=N`` (so a training script's resume path runs too);
- ``# run: s3`` runs it against the moto S3 server of ``tests/conftest.py``, with its
  endpoint in ``S3_ENDPOINT_URL`` and a bucket named ``my-bucket``.

Blocks in other languages (```sh, ```text) are not run. Other checks keep the guide's
tables in step with the code: every tunable and every command is documented, and every
``#anchor`` link points at a heading.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from asyncckpt._settings import Settings
from asyncckpt.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOC_NAMES = ("guide.md", "s3.md", "lightning.md", "sharded.md")
DOCS = [REPO / "docs" / name for name in DOC_NAMES] + [REPO / "README.md"]
#: A block its doc says to run twice runs again in the same directory: a rerun or a restart.
RUNS = ("first run", "second run, in the same directory")
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def code_blocks(path: Path, language: str = "python") -> list[tuple[int, str]]:
    """``(line number, code)`` of each fenced block in ``language``."""
    return [(line, code) for line, code, _ in _blocks_in(path, language)]


def _blocks_in(path: Path, language: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, whether the doc says to run it twice)`` of each block."""
    text = path.read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        if m.group(1) != language:
            continue
        before = text[: m.start()].rstrip().rsplit("\n\n", 1)[-1]
        after = text[m.end() :].lstrip().split("\n\n", 1)[0]
        twice = "twice" in before.lower() or "twice" in after.lower()
        found.append((text.count("\n", 0, m.start()) + 1, m.group(2), twice))
    return found


def _blocks() -> list[object]:
    params = []
    for doc in DOCS:
        for line, code, twice in _blocks_in(doc, "python"):
            rel = doc.relative_to(REPO)
            params.append(pytest.param(doc, line, code, twice, id=f"{rel}:{line}"))
    return params


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, where: str) -> None:
    try:
        result = subprocess.run(
            cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{where} did not finish within {timeout} s: {exc.stderr or ''}")
    assert result.returncode == 0, (
        f"{where} failed (exit status {result.returncode})\n--- stdout\n{result.stdout}"
        f"\n--- stderr\n{result.stderr}"
    )


@pytest.mark.parametrize(("doc", "line", "code", "twice"), _blocks())
def test_python_block_runs(
    doc: Path, line: int, code: str, twice: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = f"the python block at {doc.relative_to(REPO)}:{line}"
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    first = code.splitlines()[0].strip()
    directive = first.removeprefix("# run:").strip() if first.startswith("# run:") else None
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(script)]
    timeout = 180
    if directive is None:
        pass
    elif directive.startswith("torchrun"):
        args = shlex.split(directive)[1:]
        assert all(a.startswith("--nproc_per_node") for a in args), f"{where}: {first}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args, str(script)]
        timeout = 300
    elif directive == "s3":
        server = request.getfixturevalue("s3_server")
        server.create_bucket("my-bucket")
        # from the environment as the fixture left it (its fake AWS credentials)
        env = dict(os.environ, PYTHONPATH=str(REPO), S3_ENDPOINT_URL=server.endpoint_url)
    else:
        pytest.fail(f"{where}: unknown directive {first!r}")
    for attempt in RUNS if twice else RUNS[:1]:
        _run(cmd, work, env, timeout, f"{where} ({attempt})")


def test_the_readme_and_the_guide_have_python_blocks() -> None:
    assert len(code_blocks(REPO / "README.md")) >= 1
    # the examples that promise a rerun resumes are run twice
    readme, guide = (_blocks_in(REPO / d, "python") for d in ("README.md", "docs/guide.md"))
    assert [twice for *_, twice in readme] == [True]
    assert [code.splitlines()[0] for _, code, twice in guide if twice] == [
        "# run: torchrun --nproc_per_node=2"
    ]
    blocks = code_blocks(REPO / "docs" / "guide.md")
    firsts = [code.splitlines()[0] for _, code in blocks]
    assert len(blocks) >= 8
    assert "# run: torchrun --nproc_per_node=2" in firsts  # the DDP recipe runs on 2 ranks
    assert "# run: s3" in firsts


def test_every_tunable_is_in_the_guide() -> None:
    guide = (REPO / "docs" / "guide.md").read_text(encoding="utf-8")
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| `(\w+)` \| `ASYNCCKPT_\w+` \|.*$", guide, re.M)
    }
    assert set(rows) == set(Settings.help())
    for name, (default, _) in Settings.help().items():
        assert f"`ASYNCCKPT_{name.upper()}`" in rows[name]
        if name != "threads":  # depends on the machine; the table says how
            assert f"| {default}" in rows[name], (name, default)


def test_every_command_is_in_the_guide() -> None:
    guide = (REPO / "docs" / "guide.md").read_text(encoding="utf-8")
    parser = build_parser()
    commands = next(
        a
        for a in parser._actions
        if a.dest == "command"  # the subparsers action
    ).choices
    assert commands is not None
    for name in commands:
        assert re.search(rf"^\| `asyncckpt {name}\b", guide, re.M), name


def test_anchor_links_point_at_headings() -> None:
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        slugs = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
        for anchor in re.findall(r"\]\(#([^)]+)\)", text):
            assert anchor in slugs, f"{doc.name}: no heading for #{anchor}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_every_test_the_docs_cite_exists() -> None:
    """PROTOCOL.md backs each guarantee with a test: the file and the test it names exist."""
    cited = 0
    for doc in [*(REPO / "docs").glob("*.md"), REPO / "README.md"]:
        text = doc.read_text(encoding="utf-8")
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", text):
            assert (REPO / path).is_file(), f"{doc.name} cites {path}, which does not exist"
            if name:
                source = (REPO / path).read_text(encoding="utf-8")
                assert re.search(rf"^(async )?def {name}\(", source, re.M), (
                    f"{doc.name} cites {path}::{name}, which that file does not define"
                )
            cited += 1
    assert cited > 50  # the citations are found at all
