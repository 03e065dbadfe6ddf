"""``inspect``, ``verify`` and ``ls`` on every layout asyncckpt writes.

Layouts: a single ``asyncckpt.save`` file, a ``Checkpointer`` root of plain versions, a
``Checkpointer`` root whose version is sharded (one gloo rank saving a DTensor), and a
directory written by ``asyncckpt.dcp.Writer``. ``ls`` on a parent folder (or a bucket)
lists the roots below it; a folder holding nothing asyncckpt wrote fails with a hint.
"""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt import Checkpointer, cli
from asyncckpt.dcp import Writer
from tests import ranks

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable"),
]


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *args: Any) -> Any:
    code, out, err = run(capsys, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def _save_sharded(rank: int, world: int, workdir: Path, root: str) -> None:
    """One gloo rank saves steps 1 and 2 of a DTensor ``w`` and a plain ``step``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    with Checkpointer(root) as ckpt:
        for step in (1, 2):
            w = distribute_tensor(torch.arange(12.0).reshape(4, 3) * step, mesh, [Shard(0)])
            ckpt.save(step, {"model": {"w": w}, "step": step}).result(timeout=120)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each layout, under one parent folder ``top`` (the sharded root ``top/sharded``)."""
    top = tmp_path_factory.mktemp("layouts") / "top"
    top.mkdir()
    state = {"model": {"w": torch.ones(4, 3), "b": torch.zeros(3)}, "step": 7}
    asyncckpt.save(state, top / "single.ackpt").result()
    with Checkpointer(top / "plain") as ckpt:
        for step in (10, 20):
            ckpt.save(step, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(4, 3)}}, storage_writer=Writer(str(top / "dcpdir")))
    ranks.run(__name__, "_save_sharded", 1, top, str(top / "sharded"), timeout=200)
    return {
        "top": top,
        "single": top / "single.ackpt",
        "plain": top / "plain",
        "sharded": top / "sharded",
        "dcp": top / "dcpdir",
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["single", "plain", "sharded", "dcp"])
def test_inspect_shows_the_keys_of_every_layout(
    layouts: dict[str, Path], layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "inspect", layouts[layout])
    assert code == 0, err
    assert "model" in out and "w" in out and "float32" in out and "[4, 3]" in out
    doc = run_json(capsys, "inspect", layouts[layout])
    keys = {row["key"]: row for row in doc["entries"]}
    w = keys["state['model']['w']"]
    assert (w["dtype"], w["shape"], w["nbytes"]) == ("float32", [4, 3], 48)


@pytest.mark.timeout(300)
def test_inspect_of_a_sharded_version_shows_global_shapes_and_shards(
    layouts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    doc = run_json(capsys, "inspect", f"{layouts['sharded']}@1")
    assert doc["step"] == 1 and doc["layout"] == "sharded"
    keys = {row["key"]: row for row in doc["entries"]}
    assert keys["state['model']['w']"]["kind"] == "sharded tensor"
    assert keys["state['model']['w']"]["shards"] == 1
    assert keys["state['step']"]["value"] == "1"  # rank 0's plain values are shown


@pytest.mark.timeout(300)
def test_convert_of_a_one_rank_sharded_version_counts_its_file_in_the_singular(
    layouts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "convert", layouts["sharded"], tmp_path / "whole.ackpt")
    assert code == 0, err
    assert "(1 rank file, " in out + err and "1 rank files" not in out + err


@pytest.mark.parametrize("shards", [False, True])
def test_a_dtype_safetensors_cannot_hold_names_the_output_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shards: bool
) -> None:
    """One message whether DST is one file or a folder of shards."""
    src = tmp_path / "c.ackpt"
    asyncckpt.save({"c": torch.zeros(2, dtype=torch.complex128)}, src).result()
    dst = tmp_path / ("hub" if shards else "c.safetensors")
    code, _, err = run(capsys, "convert", src, dst, *(["--shard-size", "1MB"] if shards else []))
    assert code != 0 and "Traceback" not in err
    assert f"cannot write {dst}" in err and "c: safetensors has no dtype for" in err, err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["single", "plain", "sharded", "dcp"])
def test_verify_passes_every_layout(
    layouts: dict[str, Path], layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = run_json(capsys, "verify", layouts[layout])
    assert doc["ok"] and doc["files"] and all(f["ok"] for f in doc["files"])


@pytest.mark.timeout(300)
def test_verify_of_a_damaged_dcp_directory_fails(
    layouts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    copy = tmp_path / "dcpdir"
    shutil.copytree(layouts["dcp"], copy)
    data = next(copy.glob("*.ackpt"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # inside the first chunk's data
    data.write_bytes(bytes(raw))
    code, out, err = run(capsys, "verify", copy)
    assert code == 1 and "BAD" in out and "damaged" in err


@pytest.mark.timeout(300)
def test_ls_of_a_parent_folder_lists_the_roots_below(
    layouts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "ls", layouts["top"])
    assert code == 0, err
    for name in ("plain", "sharded", "dcpdir", "single.ackpt"):
        assert name in out
    doc = run_json(capsys, "ls", layouts["top"])
    roots = {Path(r["path"]).name: r for r in doc["roots"]}
    assert roots["plain"]["layout"] == "root" and roots["plain"]["latest"] == 20
    assert roots["sharded"]["latest"] == 2 and roots["sharded"]["stored_bytes"] > 0
    assert roots["dcpdir"]["layout"] == "dcp" and roots["dcpdir"]["latest"] is None
    assert roots["single.ackpt"]["layout"] == "file"
    assert all(r["time"] for r in roots.values())


@pytest.mark.timeout(300)
def test_ls_of_a_root_keeps_listing_its_versions(
    layouts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    doc = run_json(capsys, "ls", layouts["plain"])
    assert [v["step"] for v in doc["versions"]] == [10, 20]


def test_ls_of_a_folder_without_checkpoints_fails_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    code, out, err = run(capsys, "ls", tmp_path / "notes")
    assert code == 1 and out == ""
    assert "nothing asyncckpt wrote" in err and "notes" in err


def test_ls_of_a_bucket_lists_the_roots_below() -> None:
    """``asyncckpt ls memory://bucket/`` (as ``aws s3 ls s3://bucket/`` lists prefixes)."""
    fs = fsspec.filesystem("memory")
    url = "memory://ls-bucket"
    try:
        with Checkpointer(f"{url}/runs/a") as ckpt:
            ckpt.save(5, {"w": torch.ones(2)})
        with Checkpointer(f"{url}/b") as ckpt:
            ckpt.save(3, {"w": torch.ones(2)})
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["--json", "ls", f"{url}/"]) == 0
        roots = {
            r["path"].rstrip("/").rsplit("/", 1)[-1]: r for r in json.loads(out.getvalue())["roots"]
        }
        assert roots["a"]["latest"] == 5 and roots["b"]["latest"] == 3
    finally:
        if fs.exists(url):
            fs.rm(url, recursive=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["single", "plain", "sharded", "dcp"])
def test_inspect_key_and_depth_filter_the_rows(
    layouts: dict[str, Path], layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = [
        r["key"] for r in run_json(capsys, "inspect", layouts[layout], "--key", "model")["entries"]
    ]
    assert keys[0] == "state['model']" and "state['model']['w']" in keys
    assert all(k.startswith("state['model']") for k in keys)
    shallow = run_json(capsys, "inspect", layouts[layout], "--depth", "1")["entries"]
    assert {r["depth"] for r in shallow} == {0, 1} and "state['model']" in {
        r["key"] for r in shallow
    }
    code, _, err = run(capsys, "inspect", layouts[layout], "--key", "nope")
    assert code == 2 and "has no key 'nope'" in err


# --------------------------------------------------------------------------- the guide's table

_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"
_ROWS = {  # the guide's row name starts with → the layout it means
    "single file": "single",
    "plain root": "plain",
    "sharded root": "sharded",
    "DCP directory": "dcp",
    "parent folder": "top",
    "`torch.save` file": "pt",
    "safetensors file": "safetensors",
}
_COMMANDS = ("ls", "inspect", "verify", "gc", "convert")
_NEWEST = {"plain": 20, "sharded": 2}  # the fixture's newest steps


def _table() -> list[tuple[str, str, str]]:
    """(layout, command, cell) for every cell of the guide's "each command on each layout"
    table: the cell is the command line the guide shows, or "no"."""
    text = _GUIDE.read_text(encoding="utf-8")
    start = text.index("| layout | `ls` |")
    cells = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, *row = [c.strip() for c in line.strip("|").split("|")]
        layout = next(v for k, v in _ROWS.items() if name.startswith(k))
        cells += [(layout, command, cell) for command, cell in zip(_COMMANDS, row, strict=True)]
    return cells


def _line(command: str, cell: str, source: str, out: Path) -> list[str]:
    """The command line of one cell on ``source`` (its STEP kept), outputs under ``out``."""
    if cell.startswith("no"):
        tail = {"gc": ["--keep-last", "1"], "convert": [str(out / "x.ackpt")]}
        return [command, source, *tail.get(command, [])]
    shown = cell.split("`")[1].split()
    assert shown[0] == command, cell
    at = f"@{_NEWEST[Path(source).name]}" if "@" in shown[1] else ""  # the guide says @20
    rest = shown[2:]
    if command == "convert":  # the output, under out/
        rest = [str(out / rest[0]), *rest[1:]]
    return [command, source + at, *rest]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "command", "cell"), _table())
def test_each_command_on_each_layout_does_what_the_guides_table_says(
    layouts: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    layout: str,
    command: str,
    cell: str,
) -> None:
    import shutil

    copy = tmp_path / "top"  # gc and convert may change what they are given
    shutil.copytree(layouts["top"], copy, ignore=shutil.ignore_patterns("*.pt", "*.safetensors"))
    state = {"model.w": torch.ones(4, 3), "model.b": torch.zeros(3)}
    torch.save(state, copy / "m.pt")
    pytest.importorskip("safetensors.torch").save_file(state, str(copy / "m.safetensors"))
    names = {"single": "single.ackpt", "plain": "plain", "sharded": "sharded", "dcp": "dcpdir"}
    names |= {"pt": "m.pt", "safetensors": "m.safetensors", "top": ""}
    source = str(copy / names[layout])
    (tmp_path / "out").mkdir()
    code, out, err = run(capsys, *_line(command, cell, source, tmp_path / "out"))
    assert "Traceback" not in out + err
    if cell.startswith("no"):
        assert code != 0 and err.strip(), f"{command} on {layout}: exit {code}, {out!r}"
    else:
        assert code == 0, f"{command} on {layout} ({cell}): {err}"
        assert out.strip() or any((tmp_path / "out").iterdir())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", [["gc", "--keep-last", "1"], ["rewind", "--yes"]])
def test_gc_and_rewind_refuse_what_is_not_a_root_saying_what_it_is(
    layouts: dict[str, Path], capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    name, *flags = command
    step = ["1"] if name == "rewind" else []
    before = sorted(p.relative_to(layouts["top"]) for p in layouts["top"].rglob("*"))
    code, _, err = run(capsys, name, layouts["top"], *step, *flags)
    assert code == 2 and "not a Checkpointer root" in err
    assert "plain" in err and "sharded" in err  # the roots below, to run it on
    code, _, err = run(capsys, name, layouts["dcp"], *step, *flags)
    assert code == 2 and "asyncckpt.dcp directory" in err
    assert sorted(p.relative_to(layouts["top"]) for p in layouts["top"].rglob("*")) == before


def test_gc_of_an_empty_root_deletes_nothing_and_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fresh").mkdir()  # a root nothing was saved to yet
    code, out, err = run(capsys, "gc", tmp_path / "fresh", "--keep-last", "1")
    assert code == 0 and "freed 0 B" in out, err


@pytest.fixture
def lightning_dir(tmp_path: Path) -> Path:
    """A Lightning run's checkpoint folder: AsyncCkptIO files under Lightning's ``.ckpt``
    names (asyncckpt bytes), a ``torch.save`` one beside them, and a notes file."""
    run_dir = tmp_path / "checkpoints"
    run_dir.mkdir()
    for name, epoch in (("epoch=0-step=4.ckpt", 0), ("last.ckpt", 1)):
        asyncckpt.save({"state_dict": {"w": torch.ones(3)}, "epoch": epoch}, run_dir / name)
    asyncckpt.wait()
    torch.save({"state_dict": {"w": torch.ones(3)}}, run_dir / "stock.ckpt")
    (run_dir / "notes.txt").write_text("hello")
    return run_dir


def test_ls_of_a_folder_lists_checkpoint_files_under_torch_names(
    lightning_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = run_json(capsys, "ls", lightning_dir)
    rows = {Path(r["path"]).name: r for r in doc["roots"]}
    assert sorted(rows) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # not the torch.save file
    assert all(r["layout"] == "file" and r["stored_bytes"] for r in rows.values())


def test_verify_of_a_folder_verifies_the_checkpoint_files_in_it(
    lightning_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = run_json(capsys, "verify", lightning_dir)
    names = sorted(Path(f["file"]).name for f in doc["files"])
    assert doc["ok"] and names == ["epoch=0-step=4.ckpt", "last.ckpt"]
    last = lightning_dir / "last.ckpt"
    raw = bytearray(last.read_bytes())
    raw[len(raw) // 4] ^= 0xFF  # inside the chunk data, which precedes the manifest
    last.write_bytes(bytes(raw))
    code, out, err = run(capsys, "verify", lightning_dir)
    assert code == 1 and "last.ckpt" in out and "damaged" in err


def test_verify_of_a_folder_without_checkpoints_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = run(capsys, "verify", tmp_path)
    assert code == 1 and "nothing asyncckpt wrote" in err


@pytest.mark.timeout(300)
def test_cp_of_a_sharded_root_copies_its_rank_files_and_metadata(
    layouts: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    dst = f"memory://cp-sharded-{uuid.uuid4().hex[:8]}"
    code, _, err = run(capsys, "cp", layouts["sharded"], dst)
    assert code == 0, err
    for step in (1, 2):
        got = asyncckpt.load(f"{dst}@{step}")
        want = asyncckpt.load(f"{layouts['sharded']}@{step}")
        assert got["step"] == want["step"] == step
        assert torch.equal(got["model"]["w"], want["model"]["w"])
