"""Packaging: one version number, a license file that matches the declared license, true
dependency floors, exact linter pins, the command-line entry points, the project's metadata
(authors, addresses, classifiers) and an sdist that carries what the README links to.

Installing the wheel is ``make wheel-check`` (part of ``make test``); these tests read the
sources, and one builds the sdist (a few seconds).
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import asyncckpt
from asyncckpt._version import __version__

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; 3.10 runs the rest of the suite

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    with open(REPO / "pyproject.toml", "rb") as f:
        doc: dict[str, Any] = tomllib.load(f)
    return doc


def requirement(specs: list[str], name: str) -> str:
    found = [s for s in specs if re.match(rf"{re.escape(name)}(\[|[<>=!~ ]|$)", s)]
    assert len(found) == 1, (name, specs)
    return found[0]


def test_the_version_is_written_once(project: dict[str, Any]) -> None:
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "asyncckpt._version.__version__"}
    assert asyncckpt.__version__ == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]\d+|rc\d+)?", __version__)
    written = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "asyncckpt").rglob("*.py")
        if re.search(r"__version__\s*=", p.read_text(encoding="utf-8"))
    ]
    assert written == ["asyncckpt/_version.py"]


def test_the_license_file_is_the_apache_2_text(project: dict[str, Any]) -> None:
    assert project["project"]["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    sections = re.findall(r"^   (\d)\. ([A-Z][\w ]+)\.", text, re.M)
    assert [int(n) for n, _ in sections] == list(range(1, 10))
    assert len(text.split()) > 1500  # the full text, not a notice pointing at it


def test_dependency_floors(project: dict[str, Any]) -> None:
    deps = project["project"]["dependencies"]
    assert requirement(deps, "torch").startswith("torch>=2.5")  # serialization.safe_globals
    assert requirement(deps, "fsspec") == "fsspec>=2025.10.0"  # ChainedFileSystem
    extras = project["project"]["optional-dependencies"]
    # s3fs X requires fsspec==X: a lower s3fs floor than fsspec's could never be installed
    assert requirement(extras["s3"], "s3fs") == "s3fs>=2025.10.0"
    assert requirement(extras["safetensors"], "safetensors") == "safetensors>=0.8"
    for extra in ("dev", "bench"):
        assert requirement(extras[extra], "safetensors") == "safetensors>=0.8"
        assert requirement(extras[extra], "matplotlib").startswith("matplotlib>=")
    import torch
    from torch import serialization

    assert hasattr(serialization, "safe_globals"), torch.__version__
    from fsspec.implementations.chained import ChainedFileSystem  # noqa: F401


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_linters_are_pinned_to_what_lints_the_code(project: dict[str, Any], tool: str) -> None:
    pin = requirement(project["project"]["optional-dependencies"]["dev"], tool)
    assert re.fullmatch(rf"{tool}==[\d.]+", pin), pin
    try:
        installed = metadata.version(tool)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{tool} is not installed")
    assert pin == f"{tool}=={installed}"


def test_the_console_script_and_python_m_run_the_cli(project: dict[str, Any]) -> None:
    target = project["project"]["scripts"]["asyncckpt"]
    assert target == "asyncckpt.cli:main"
    module, _, name = target.partition(":")
    main = getattr(importlib.import_module(module), name)
    assert callable(main) and main(["--version"]) == 0
    result = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == f"asyncckpt {__version__}"


def test_the_cli_package_imports_downward_only() -> None:
    """main imports the command modules and the parsers, which import the formats (and the
    sharded layouts) and the listing, which import common."""
    layers = [
        {"main"},
        {"cp"},
        {"ls", "inspect", "verify", "gc", "rewind", "convert", "bench", "parsers"},
        {"formats", "listing"},
        {"common", "terminal"},
        {"progress"},
    ]
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    folder = REPO / "asyncckpt" / "cli"
    assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == set(rank)
    for name, level in rank.items():
        source = (folder / f"{name}.py").read_text(encoding="utf-8")
        imports = r"^from asyncckpt\.cli\.(\w+) import|^from asyncckpt\.cli import (.+)$"
        for imported in re.findall(imports, source, re.M):
            for target in filter(None, re.split(r"[,\s]+", " ".join(imported))):
                assert rank[target] > level or target == name, (name, target)


def test_only_the_writer_process_channel_unpickles() -> None:
    """Loading never unpickles (docs/FORMAT.md, R11): pickle is confined to the private
    socket between a training process and its own writer process."""
    package = Path(asyncckpt.__file__).parent
    unpickling = re.compile(r"\bpickle\.(loads?|Unpickler)\(|from pickle import")
    users = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if unpickling.search(path.read_text(encoding="utf-8"))
    )
    assert users == ["_engine/writer_child.py", "_engine/writer_process.py"]


def _torch_load_callers(package: Path) -> list[str]:
    """Modules that call ``torch.load`` (or ``torch.serialization.load``), found in their
    syntax tree: docstrings and messages that mention it do not count."""
    import ast

    def calls_torch_load(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            return False
        owner = ast.unparse(node.func.value)
        return node.func.attr == "load" and owner in ("torch", "torch.serialization")

    return sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if any(calls_torch_load(n) for n in ast.walk(ast.parse(path.read_text("utf-8"))))
    )


def test_torch_load_runs_only_where_the_docs_say() -> None:
    """docs/FORMAT.md §11 names every place that unpickles: besides the writer process's
    socket, only ``asyncckpt convert`` (and ``bench``) reading a ``torch.save`` source, and
    ``convert`` of an ``asyncckpt.dcp`` directory's bytes items, both ``weights_only=True``.
    No module of the load path calls ``torch.load`` or imports those two."""
    package = Path(asyncckpt.__file__).parent
    assert _torch_load_callers(package) == ["_convert/consolidate.py", "cli/formats.py"]
    for name in ("_convert/consolidate.py", "cli/formats.py"):
        source = (package / name).read_text(encoding="utf-8")
        calls = re.findall(r"\btorch\.load\((.*?)\)\s*$", source, re.M)
        assert calls and all("weights_only=True" in c for c in calls), (name, calls)
    importers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(
            r"^from asyncckpt\.(_convert\.consolidate|cli\.formats) import", path.read_text(), re.M
        )
    )
    assert importers and all(name.startswith("cli/") for name in importers), importers
    formats = (REPO / "docs" / "FORMAT.md").read_text(encoding="utf-8")
    section = formats.split("## 11. Why no pickle", 1)[1].split("\n## ", 1)[0]
    for place in ("writer process", "asyncckpt convert", "weights_only=True", "bytes items"):
        assert place in section, place
    assert "nothing read from storage is ever unpickled" not in formats


def test_the_project_says_who_wrote_it_and_where_it_lives(project: dict[str, Any]) -> None:
    meta = project["project"]
    assert meta["authors"] and all(a["name"] and "@" in a["email"] for a in meta["authors"])
    urls = meta["urls"]
    assert set(urls) >= {"Homepage", "Documentation", "Source", "Issues", "Changelog"}
    assert all(u.startswith(urls["Source"]) for u in urls.values()), urls
    assert urls["Changelog"].endswith("/CHANGELOG.md") and (REPO / "CHANGELOG.md").is_file()
    assert urls["Documentation"].endswith("/docs/guide.md")


def test_the_classifiers_match_the_rest_of_the_metadata(project: dict[str, Any]) -> None:
    meta = project["project"]
    classifiers = meta["classifiers"]
    assert len(set(classifiers)) == len(classifiers)
    # PEP 639: the license expression replaces license classifiers (setuptools refuses both)
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert "Typing :: Typed" in classifiers and (REPO / "asyncckpt" / "py.typed").is_file()
    floor = re.fullmatch(r">=3\.(\d+)", meta["requires-python"])
    assert floor, meta["requires-python"]
    minors = [
        int(m)
        for c in classifiers
        for m in re.findall(r"^Programming Language :: Python :: 3\.(\d+)$", c)
    ]
    assert minors and min(minors) == int(floor.group(1)), minors
    assert sys.version_info.minor in minors  # the Python that runs these tests is listed


def test_no_test_filesystem_is_an_entry_point(project: dict[str, Any]) -> None:
    """faulty:// is registered by importing asyncckpt.testing only: an fsspec entry point
    would register it in every process of every user of the package."""
    assert "fsspec.specs" not in project["project"].get("entry-points", {})
    source = (REPO / "asyncckpt" / "testing" / "__init__.py").read_text(encoding="utf-8")
    assert "register_implementation" in source


def test_the_wheel_ships_no_test_server() -> None:
    """The local S3 servers, the fault proxy and the in-memory S3 are asyncckpt's own test
    doubles (tests/): no module of the package starts moto, SeaweedFS or an HTTP server."""
    server_modules = re.compile(r"^\s*(from|import)\s+(moto|werkzeug|http\.server|socketserver)\b")
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "asyncckpt").rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if server_modules.match(line) or '"weed"' in line
    ]
    assert not found, found


def _relative_links(doc: Path) -> set[str]:
    """Repository paths of the files ``doc`` links to (addresses and anchors dropped)."""
    text = doc.read_text(encoding="utf-8")
    targets = set()
    for link in re.findall(r"\]\(([\w./:-]+)(?:#[\w-]*)?\)", text):
        if not re.match(r"[a-z]+:", link):  # not an address
            targets.add((doc.parent / link).resolve().relative_to(REPO).as_posix())
    return targets


def _copy_sources(dest: Path) -> None:
    """The files git would commit (tracked, or new and not ignored), without build output."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    for name in listed:
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


@pytest.mark.timeout(300)
def test_the_sdist_holds_what_the_readme_and_docs_link_to(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    pytest.importorskip("build")
    source, out = tmp_path / "src", tmp_path / "dist"
    _copy_sources(source)  # a copy: the build writes asyncckpt.egg-info into its source tree
    result = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
        top = sdist.name.removesuffix(".tar.gz")
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()  # type: ignore[union-attr]
        entry_points = tar.extractfile(f"{top}/asyncckpt.egg-info/entry_points.txt")
        entry_text = entry_points.read().decode() if entry_points else ""
    linked = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        linked |= _relative_links(doc)
    assert "docs/guide.md" in linked and "benchmarks/results/bench_codec.png" in linked
    assert not linked - names, sorted(linked - names)
    assert {"CHANGELOG.md", "LICENSE", "README.md"} <= names
    assert {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} <= names
    for field in ("Author-email: ", "Project-URL: Changelog, ", "Classifier: Typing :: Typed"):
        assert field in pkg_info, field
    assert "[console_scripts]" in entry_text and "fsspec.specs" not in entry_text
