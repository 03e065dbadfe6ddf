"""The ``asyncckpt`` command line, the progress bar, and the library's logging.

Each command runs at least once as a user runs it — ``python -m asyncckpt ...`` in a
subprocess whose stdout and stderr are pipes, not a terminal — on real checkpoints written by
``asyncckpt.save`` and ``Checkpointer``, locally and on S3 (a moto server). Finer checks call
``asyncckpt.cli.main`` in-process, which is the same code without the interpreter start-up.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import asyncckpt
from asyncckpt import cli
from asyncckpt._engine.decode import open_file
from asyncckpt._storage import resolve
from asyncckpt._versions.protocol import VERSION_FILE
from asyncckpt.cli.progress import Progress, format_bytes
from asyncckpt.errors import ChecksumError

REPO = Path(__file__).resolve().parents[2]
STEPS = (10, 20, 30)


def run_cli(*args: Any, cwd: Path | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``python -m asyncckpt ARGS`` with pipes for stdout and stderr (not a terminal)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-m", "asyncckpt", *map(str, args)],
        text=True,
        cwd=cwd,
        env=env,
        timeout=180,
        **kw,
    )


def main(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    """``asyncckpt.cli.main(ARGS)`` in-process: (exit status, stdout, stderr)."""
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def state_at(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": step,
        "rng": np.random.default_rng(step).integers(0, 2**31, 64, dtype=np.int64),
    }


def equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def made_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Committed steps 10, 20, 30 (the version file names 30); step 15 is a leftover of an
    interrupted save and step 40 a save in progress (data, no ``COMMIT``)."""
    root = tmp_path_factory.mktemp("cli") / "run"
    with asyncckpt.Checkpointer(root, compression="zstd") as ckpt:  # codecs shown below
        for step in STEPS:
            ckpt.save(step, state_at(step))
    data = next((root / "10").glob("*.ackpt"))
    for step in (15, 40):
        (root / str(step)).mkdir()
        shutil.copy(data, root / str(step) / data.name)
    return root


@pytest.fixture
def root(made_root: Path, tmp_path: Path) -> Path:
    """A private copy of ``made_root`` that a test may change."""
    copy = tmp_path / "run"
    shutil.copytree(made_root, copy)
    return copy


def data_file(root: Path, step: int) -> Path:
    return next((root / str(step)).glob("*.ackpt"))


def tree(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*")}


# -- ls -------------------------------------------------------------------------------------


def test_ls_shows_committed_incomplete_and_the_version_file(
    made_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_cli("ls", made_root, "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    doc = json.loads(result.stdout)
    versions = {v["step"]: v for v in doc["versions"]}
    assert sorted(versions) == [10, 15, 20, 30, 40]
    assert {s: v["state"] for s, v in versions.items()} == {
        10: "committed",
        15: "incomplete",
        20: "committed",
        30: "committed",
        40: "incomplete",
    }
    assert doc["version_file"]["step"] == 30 and doc["latest"] == 30
    assert [s for s, v in versions.items() if v["latest"]] == [30]
    for step in STEPS:
        v = versions[step]
        assert v["raw_bytes"] > 0 and v["stored_bytes"] == data_file(made_root, step).stat().st_size
        assert v["time"] and v["ratio"] == v["stored_bytes"] / v["raw_bytes"]
    assert versions[40]["raw_bytes"] is None and versions[40]["stored_bytes"] > 0

    code, out, _ = main(capsys, "ls", made_root)
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[2:] if line.split()}
    assert rows["30"].endswith("<- version file")
    assert "incomplete" in rows["15"] and "incomplete" in rows["40"]
    assert all("version file" not in rows[s] for s in ("10", "15", "20", "40"))
    assert "committed" in rows["10"] and "%" in rows["10"]


def test_ls_follows_a_damaged_version_file(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / VERSION_FILE).write_text("{not json")
    code, out, _ = main(capsys, "ls", root, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["version_file"] is None and doc["latest"] == 30
    code, out, _ = main(capsys, "ls", root)
    assert "version file: missing or damaged; readers use the newest committed step, 30" in out


# -- inspect --------------------------------------------------------------------------------


def test_inspect_shows_keys_dtypes_shapes_devices_codecs(
    made_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_cli("inspect", f"{made_root}@20", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["step"] == 20 and doc["file"].endswith(data_file(made_root, 20).name)
    rows = {r["key"]: r for r in doc["entries"]}
    weight = rows["state['model']['weight']"]
    assert weight["kind"] == "tensor" and weight["dtype"] == "float32"
    assert weight["shape"] == [16, 32] and weight["nbytes"] == 16 * 32 * 4
    assert weight["device"] == "cpu" and weight["codecs"] == ["zstd-bytegroup"]
    assert rows["state['step']"] == {
        "key": "state['step']",
        "depth": 1,
        "kind": "int",
        "value": "20",
    }
    assert rows["state['model']"]["kind"] == "OrderedDict"
    assert rows["state['rng']"]["kind"] == "ndarray" and rows["state['rng']"]["shape"] == [64]
    assert rows["state['optim']['param_groups'][0]['lr']"]["value"] == "0.001"
    assert doc["raw_bytes"] == sum(r.get("storage_bytes", 0) for r in doc["entries"]) + 64 * 8

    code, out, _ = main(capsys, "inspect", data_file(made_root, 30))
    assert code == 0
    assert "(step" not in out.splitlines()[0]  # a plain file has no step
    line = next(ln for ln in out.splitlines() if "['weight']" in ln)
    assert line.split()[1:5] == ["tensor", "float32", "[16,", "32]"] and "cpu" in line


# -- verify ---------------------------------------------------------------------------------


def test_verify_passes_a_sound_root_quietly(
    made_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = main(capsys, "verify", made_root, "--all", "--json")
    assert code == 0
    assert err == ""  # no progress bar: stderr is not a terminal
    doc = json.loads(out)
    assert doc["ok"] is True
    assert [f["step"] for f in doc["files"]] == list(STEPS)
    assert all(f["ok"] and f["chunks"] > 0 and not f["bad_chunks"] for f in doc["files"])
    assert any("step 15, 40" in w for w in doc["warnings"])  # uncommitted, not failures

    code, out, err = main(capsys, "verify", made_root)  # ROOT alone: the latest version
    assert code == 0 and err == ""
    assert out.count("OK ") == 1 and "(step 30)" in out and "1 of 1 file sound" in out


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_verify_names_every_damaged_chunk_and_its_keys(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = data_file(root, 30)
    with open_file(*resolve(path, None)) as opened:
        manifest = opened.manifest
    keys = {"state['model']['weight']", "state['optim']['state'][0]['exp_avg_sq']"}
    storages = {t.key: t.storage for t in manifest.tensors}
    damaged = {}
    for key in keys:
        chunk = manifest.storages[storages[key]].first_chunk
        damaged[chunk] = key
        c = manifest.chunks[chunk]
        _flip(path, c.offset + c.stored_len // 2)
    with pytest.raises(ChecksumError):
        asyncckpt.load(path)  # a load stops at the first bad chunk; verify goes on

    result = run_cli("verify", path)
    assert result.returncode == 1
    assert "damaged" in one_line(result.stderr)
    for chunk, key in damaged.items():
        line = next(ln for ln in result.stdout.splitlines() if f"chunk {chunk}:" in ln)
        assert "checksum mismatch" in line and key in line
    assert "0 of 1 file sound; 1 damaged (2 bad chunks)" in result.stdout

    code, out, _ = main(capsys, "verify", root, "--all", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False
    assert [f["ok"] for f in doc["files"]] == [True, True, False]
    bad = doc["files"][2]["bad_chunks"]
    assert {b["chunk"]: b["keys"] for b in bad} == {c: [k] for c, k in damaged.items()}


def test_verify_fails_on_a_truncated_file(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = data_file(root, 20)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    code, out, err = main(capsys, "verify", root, "--all")
    assert code == 1
    one_line(err)
    bad = [ln for ln in out.splitlines() if ln.startswith("BAD")]
    assert len(bad) == 1 and path.name in bad[0] and "(step 20)" in bad[0]
    assert "truncated" in out
    assert "2 of 3 files sound" in out

    code, _, err = main(capsys, "verify", f"{root}@20")
    assert code == 1 and "1 of 1 file damaged" in one_line(err)
    code, _, _ = main(capsys, "verify", f"{root}@30")
    assert code == 0


def _with_edited_manifest(path: Path, edit: Any) -> None:
    """Rewrite the manifest of the file at ``path`` through ``edit(doc)``, footer matching."""
    from asyncckpt._format.container import FOOTER_SIZE, encode_footer

    data = path.read_bytes()
    offset, length = struct.unpack("<QQ", data[-FOOTER_SIZE:][:16])
    doc = json.loads(data[offset : offset + length])
    edit(doc)
    body = json.dumps(doc).encode()
    path.write_bytes(data[:offset] + body + encode_footer(offset, body))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["arrays"][0].__setitem__(1, "<f4\n"), "unsupported numpy dtype '<f4\\\\n'"),
        (
            lambda d: d["root"]["dict"].append(["s", {"size": [2, 2**70]}]),
            "torch.Size entry 1180591620717411303424 is outside int64",
        ),
    ],
    ids=["dtype-newline", "size-2**70"],
)
def test_verify_fails_on_what_load_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, message: str
) -> None:
    """A manifest that validation once let through ("sound") but load could not use."""
    path = tmp_path / "x.ackpt"
    asyncckpt.save({"a": np.zeros(3, dtype=np.float32)}, path).result()
    _with_edited_manifest(path, edit)
    code, out, err = main(capsys, "verify", path)
    assert code == 1 and "1 of 1 file damaged" in one_line(err)
    assert out.startswith("BAD") and message.replace("\\\\", "\\") in out
    with pytest.raises(asyncckpt.errors.FormatError, match=r"x\.ackpt"):
        asyncckpt.load(path)


def test_verify_of_a_step_that_is_not_committed(
    made_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = main(capsys, "verify", f"{made_root}@40")
    assert code == 1
    assert "step 40 is not committed" in one_line(err) and "10, 20, 30" in err


# -- gc -------------------------------------------------------------------------------------


def test_gc_dry_run_deletes_nothing_and_gc_applies_retention(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / "VERSION.acktmp-0123456789ab").write_bytes(b"partial")
    before = tree(root)
    result = run_cli("gc", root, "--keep", "1", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [d["step"] for d in doc["delete"]] == [10, 15, 20]
    assert doc["dry_run"] is True and doc["version_file_step"] == 30 and doc["kept"] == [30, 40]
    assert tree(root) == before  # nothing deleted

    code, out, _ = main(capsys, "gc", root, "--keep", "1")
    assert code == 0
    assert "deleted step 10 (committed" in out and "deleted step 15 (incomplete" in out
    assert sorted(p.name for p in root.iterdir()) == [
        "30",
        "40",  # newer than the version file's step: a save in progress is never touched
        "VERSION",
        "VERSION.acktmp-0123456789ab",  # kept without --remove-temp
        "VERSION.lock",  # the version file's lock and the writer lease (docs/PROTOCOL.md)
        "_lease",
    ]
    assert asyncckpt.Checkpointer(root, writer_rank=1).versions() == [30]
    code, out, _ = main(capsys, "gc", root, "--keep", "1", "--remove-temp")
    assert code == 0 and not (root / "VERSION.acktmp-0123456789ab").exists()


def test_gc_pins_the_step_the_version_file_names(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads((root / VERSION_FILE).read_text())
    (root / VERSION_FILE).write_text(json.dumps({**doc, "step": 20}))
    code, out, _ = main(capsys, "gc", root, "--keep", "1", "--json")
    assert code == 0
    assert [d["step"] for d in json.loads(out)["delete"]] == [10, 15]
    names = sorted(p.name for p in root.iterdir())
    assert names == ["20", "30", "40", "VERSION", "VERSION.lock", "_lease"]


# -- convert --------------------------------------------------------------------------------


class Opaque:
    """A class ``torch.load(weights_only=True)`` refuses to unpickle."""


def flat_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return {
        "f32": base,
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "f16": torch.randn(4, 4, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "i64": torch.arange(-5, 5),
        "i32": torch.arange(9, dtype=torch.int32).reshape(3, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # non-contiguous
    }


def test_convert_round_trip_torch_ackpt_safetensors_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = flat_state()
    torch.save(original, tmp_path / "a.pt")
    result = run_cli("convert", "a.pt", "b.ackpt", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    doc = json.loads(result.stdout)
    assert doc["src_format"] == "torch" and doc["dst_format"] == "ackpt"
    assert doc["tensors"] == len(original)
    assert equal(asyncckpt.load(tmp_path / "b.ackpt"), original)

    assert main(capsys, "convert", tmp_path / "b.ackpt", tmp_path / "c.safetensors")[0] == 0
    assert main(capsys, "convert", tmp_path / "c.safetensors", tmp_path / "d.pt")[0] == 0
    back = torch.load(tmp_path / "d.pt", weights_only=True)
    assert set(back) == set(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape, key
        assert torch.equal(back[key], tensor), key

    # The safetensors file follows the published layout.
    raw = (tmp_path / "c.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and raw[8:9] == b"{"
    # safetensors sorts its header; the dict's order is recorded to be restored on reading
    assert header.pop("__metadata__") == {
        "format": "pt",
        "asyncckpt.order": json.dumps(list(original), separators=(",", ":")),
    }
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert header["bf16"] == {
        "dtype": "BF16",
        "shape": [7],
        "data_offsets": list(header["bf16"]["data_offsets"]),
    }
    begin, end = header["f32"]["data_offsets"]
    f32 = np.frombuffer(raw[8 + n + begin : 8 + n + end], dtype="<f4").reshape(6, 5)
    assert np.array_equal(f32, original["f32"].numpy())
    from safetensors.torch import load_file  # the dev extra installs it: never skipped

    other = load_file(tmp_path / "c.safetensors")
    assert all(torch.equal(other[k], v) for k, v in original.items())


def test_convert_a_checkpoint_root_and_its_parts(
    made_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = main(capsys, "convert", made_root, tmp_path / "all.pt")
    assert code == 0 and "30" in out
    assert equal(torch.load(tmp_path / "all.pt", weights_only=False), state_at(30))

    code, _, err = main(capsys, "convert", f"{made_root}@20", tmp_path / "x.safetensors")
    assert code == 1
    assert "flat dict" in one_line(err) and "--key model" in err
    assert not (tmp_path / "x.safetensors").exists()

    dst = tmp_path / "model.safetensors"
    assert main(capsys, "convert", f"{made_root}@20", dst, "--key", "model")[0] == 0
    assert main(capsys, "convert", dst, tmp_path / "model.ackpt")[0] == 0
    model = asyncckpt.load(tmp_path / "model.ackpt")
    assert equal(dict(model), dict(state_at(20)["model"]))

    # the torch file holds numpy arrays (weights_only accepts plain ones here) -> asyncckpt
    assert main(capsys, "convert", tmp_path / "all.pt", tmp_path / "again.ackpt")[0] == 0
    assert equal(asyncckpt.load(tmp_path / "again.ackpt"), state_at(30))


def test_convert_refuses_what_it_cannot_do(
    made_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    code, _, err = main(capsys, "convert", tmp_path / "a.pt", tmp_path / "out.weird")
    assert code == 2 and "--to" in one_line(err)
    code, _, _ = main(capsys, "convert", tmp_path / "a.pt", tmp_path / "out.weird", "--to", "torch")
    assert code == 0
    code, _, err = main(
        capsys, "convert", tmp_path / "a.pt", tmp_path / "out.weird", "--to", "torch"
    )
    assert code == 2 and "--force" in one_line(err)
    code, _, err = main(capsys, "convert", made_root, tmp_path / "k.pt", "--key", "nope")
    assert code == 2 and "'model'" in one_line(err)

    torch.save({"x": Opaque()}, tmp_path / "custom.pt")
    code, _, err = main(capsys, "convert", tmp_path / "custom.pt", tmp_path / "c.ackpt")
    assert code == 1 and "weights_only=True" in one_line(err)

    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    code, _, err = main(capsys, "convert", tmp_path / "bad.safetensors", tmp_path / "b.pt")
    assert code == 1 and "not a valid safetensors file" in one_line(err)


# -- bench ----------------------------------------------------------------------------------


def test_bench_prints_a_table_writes_json_and_a_plot(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    result = run_cli(
        "bench", store, "--size-mib", "1", "--repeat", "1", "--json", "--plot", tmp_path / "b.png"
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["raw_bytes"] == 1 << 20
    assert set(doc["results"]) == {
        "copy into preallocated buffers",
        "torch.save (sync, durable)",
        "asyncckpt.save: caller blocked",
        "asyncckpt.save: until durable",
        "torch.load (weights_only)",
        "asyncckpt.load",
    }
    assert all(r["median_s"] > 0 and len(r["runs_s"]) == 1 for r in doc["results"].values())
    assert doc["stored_bytes"]["torch"] > 1 << 20 > doc["stored_bytes"]["asyncckpt"] > 0
    assert list(store.iterdir()) == []  # the temporary folder is removed
    text = run_cli("bench", store, "--size-mib", "1", "--repeat", "1", "--no-plot")
    assert "first asyncckpt.save of a process also sets up" in text.stdout  # says what it is
    assert "--repeat 3" in text.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert doc["plot"] is None
    else:
        assert doc["plot"] == str(tmp_path / "b.png")
        assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- progress -------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_only_on_a_terminal() -> None:
    quiet = io.StringIO()
    with Progress(1000, "read", stream=quiet) as bar:
        bar.update(1000)
    assert quiet.getvalue() == "" and bar.done == 1000

    screen = _Terminal()
    with Progress(4 << 20, "read", stream=screen, interval=0) as bar:
        bar.update(1 << 20)
        bar.update(3 << 20)
    text = screen.getvalue()
    assert text.startswith("\rread [") and text.endswith("\n")
    assert " 25.0%" in text and "100.0%" in text and "4.0 MiB / 4.0 MiB" in text and "/s" in text

    off = _Terminal()
    with Progress(10, "x", stream=off, enabled=False) as bar:
        bar.update(10)
    assert off.getvalue() == ""
    assert format_bytes(0) == "0 B" and format_bytes(1536) == "1.5 KiB"


def test_verify_draws_progress_on_a_terminal_stderr(made_root: Path) -> None:
    controller, terminal = pty.openpty()
    received: list[bytes] = []
    finished = threading.Event()

    def pump() -> None:  # read while the child writes, so it never blocks on a full pty
        while True:
            ready, _, _ = select.select([controller], [], [], 0.1)
            if ready:
                received.append(os.read(controller, 1 << 16))
            elif finished.is_set():
                return

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        result = run_cli("verify", made_root, "--all", stderr=terminal)
    finally:
        finished.set()
        reader.join(30)
        os.close(terminal)  # closed only now: its buffered output is read in full first
        os.close(controller)
    drawn = b"".join(received)
    assert result.returncode == 0
    assert b"verify [" in drawn and b"100.0%" in drawn and b"/s" in drawn
    assert "every checksum matches" in result.stdout and "verify [" not in result.stdout


# -- errors and usage -------------------------------------------------------------------------


def test_errors_are_one_line_and_usage_errors_exit_2(
    made_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = Path(sys.executable).with_name("asyncckpt")  # the console script, if installed
    command = [script] if script.exists() else [sys.executable, "-m", "asyncckpt"]
    result = subprocess.run([*command, "ls"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 2 and result.stdout == ""
    assert "required: ROOT" in one_line(result.stderr)

    code, _, err = main(capsys, "ls", tmp_path / "missing")
    assert code == 1 and "no such file or checkpoint root" in one_line(err)
    code, _, err = main(capsys, "gc", data_file(made_root, 10), "--keep", "1")
    assert code == 2 and "is a file" in one_line(err)  # ls FILE lists it (test_cli_paths.py)
    code, _, err = main(capsys, "gc", made_root, "--keep", "0")
    assert code == 2 and "--keep" in one_line(err)
    code, _, err = main(capsys, "verify", data_file(made_root, 10), "--all")
    assert code == 2 and "--all" in one_line(err)
    code, _, err = main(capsys, "ls", made_root, "--storage-option", "oops")
    assert code == 2 and "KEY=VALUE" in one_line(err)
    code, _, err = main(capsys, "frobnicate")
    assert code == 2 and "invalid choice" in one_line(err)
    torch.save({"w": torch.ones(1)}, tmp_path / "t.pt")
    # inspect shows a torch.save file (tests/cli/test_cli_formats.py); verify checks asyncckpt
    # checksums only, and says what the file is
    code, _, err = main(capsys, "verify", tmp_path / "t.pt")
    assert code == 1 and "is a torch file, not an asyncckpt file" in one_line(err)

    code, out, err = main(capsys, "ls", tmp_path / "missing", "--json")
    assert code == 1 and json.loads(out)["ok"] is False and json.loads(out)["exit_status"] == 1
    one_line(err)
    code, _, err = main(capsys, "ls", tmp_path / "missing", "--debug")
    assert code == 1 and "Traceback" in err and "CheckpointNotFoundError" in err


def test_storage_options_parse_as_json_and_nest() -> None:
    assert cli.parse_storage_options(
        ["endpoint_url=http://h:9000", "anon=true", "n=3", "client_kwargs.region_name=eu-west-1"]
    ) == {
        "endpoint_url": "http://h:9000",
        "anon": True,
        "n": 3,
        "client_kwargs": {"region_name": "eu-west-1"},
    }


def test_endpoint_url_is_a_storage_option(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["ls", "memory://cli-endpoint", "--endpoint-url", "http://127.0.0.1:9000"]
    code, _, err = main(capsys, *args, "-o", "endpoint_url=http://127.0.0.1:9001")
    assert code == 2 and "--endpoint-url http://127.0.0.1:9000" in one_line(err)
    assert "-o endpoint_url=http://127.0.0.1:9001" in err  # two endpoints: which one?
    code, _, err = main(capsys, *args, "-o", "endpoint_url=http://127.0.0.1:9000")
    assert "unrecognized" not in err and code == 1  # the same one twice; no root there


def test_commands_work_on_memory_urls(capsys: pytest.CaptureFixture[str]) -> None:
    url = "memory://cli-test-root"
    try:
        with asyncckpt.Checkpointer(url, keep_last=2) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(step, {"w": torch.full((3,), float(step))})
        code, out, _ = main(capsys, "ls", url, "--json")
        assert code == 0 and [v["step"] for v in json.loads(out)["versions"]] == [2, 3]
        assert main(capsys, "verify", url, "--all")[0] == 0
        assert main(capsys, "inspect", f"{url}@2")[0] == 0
        assert main(capsys, "gc", url, "--keep", "1")[0] == 0
        assert asyncckpt.Checkpointer(url, writer_rank=1).versions() == [3]
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)


# -- S3 ---------------------------------------------------------------------------------------


def test_commands_on_s3(
    s3_root: str, s3_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = s3_server.storage_options
    with asyncckpt.Checkpointer(s3_root, keep_last=2, storage_options=options) as ckpt:
        for step in STEPS:
            ckpt.save(step, state_at(step))
    endpoint = ["--storage-option", f"endpoint_url={s3_server.endpoint_url}"]

    result = run_cli("ls", s3_root, "--json", *endpoint)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [(v["step"], v["state"], v["latest"]) for v in doc["versions"]] == [
        (20, "committed", False),
        (30, "committed", True),
    ]
    # the aws CLI's flag is taken too: it is the storage option endpoint_url
    code, out, _ = main(
        capsys, "verify", s3_root, "--all", "--endpoint-url", s3_server.endpoint_url
    )
    assert code == 0 and out.count("every checksum matches") == 2
    assert main(capsys, "convert", f"{s3_root}@20", tmp_path / "s20.pt", *endpoint)[0] == 0
    assert equal(torch.load(tmp_path / "s20.pt", weights_only=False), state_at(20))

    code, out, _ = main(capsys, "inspect", s3_root, "--json", *endpoint)
    assert code == 0 and json.loads(out)["step"] == 30
    # damage the newest version in the bucket: verify names the chunk and the key
    fs = s3_server.filesystem()
    key = next(p for p in fs.ls(f"{s3_root}/30") if p.endswith(".ackpt"))
    with open_file(*resolve(f"s3://{key}", options)) as opened:
        manifest = opened.manifest
    chunk = manifest.chunks[manifest.storages[manifest.tensors[0].storage].first_chunk]
    data = bytearray(fs.cat_file(key))
    data[chunk.offset] ^= 1
    fs.pipe_file(key, bytes(data))
    code, out, err = main(capsys, "verify", s3_root, *endpoint)
    assert code == 1 and manifest.tensors[0].key in out and "checksum mismatch" in out
    one_line(err)


# -- the library's logging ------------------------------------------------------------------


def test_each_completed_save_logs_one_info_line_with_its_stats(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncckpt")
    path = tmp_path / "logged.ackpt"
    info = asyncckpt.save({"w": torch.zeros(1000)}, path).result()
    deadline = time.monotonic() + 30  # the line is logged by the save's completion callback
    while not [r for r in caplog.records if str(path) in r.getMessage()]:
        assert time.monotonic() < deadline, "no log line for the save"
        time.sleep(0.01)
    lines = [
        r for r in caplog.records if r.name == "asyncckpt._api.jobs" and str(path) in r.getMessage()
    ]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    message = lines[0].getMessage()
    stats = info.stats
    assert stats.total_s is not None and stats.stored_bytes is not None
    assert f"blocked {stats.blocking_s:.3f} s" in message
    assert f"durable after {stats.total_s:.3f} s" in message
    assert f"{stats.raw_bytes} bytes raw" in message and f"{stats.stored_bytes} stored" in message
    assert stats.throughput is not None
    assert f"{stats.throughput / 1e6:.1f} MB/s" in message


def run_python(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=180,
    )


def test_the_library_prints_nothing(tmp_path: Path) -> None:
    script = """
import torch, asyncckpt
h = asyncckpt.save({"w": torch.randn(100)}, "one.ackpt")
h.result()
asyncckpt.load("one.ackpt")
with asyncckpt.Checkpointer("run", keep_last=1) as ckpt:
    for step in range(3):
        ckpt.save(step, {"w": torch.randn(100), "step": step})
    ckpt.load()
"""
    result = run_python(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    assert sorted(os.listdir(tmp_path / "run")) == ["2", "VERSION", "VERSION.lock", "_lease"]


def test_a_save_pending_at_exit_is_finished_without_printing(tmp_path: Path) -> None:
    script = """
import torch, asyncckpt
asyncckpt.save({"w": torch.ones(3)}, "pending.ackpt")  # still pending at exit: waited for
"""
    result = run_python(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert torch.equal(asyncckpt.load(tmp_path / "pending.ackpt")["w"], torch.ones(3))
    assert result.stdout == "" and result.stderr == ""


def test_inspect_tree_of_an_ordered_dict_with_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sd = torch.nn.Linear(2, 2).state_dict()
    assert isinstance(sd, OrderedDict) and hasattr(sd, "_metadata")
    asyncckpt.save({"sd": sd, "tied": [sd["weight"], sd["weight"]]}, tmp_path / "m.ackpt").result()
    code, out, _ = main(capsys, "inspect", tmp_path / "m.ackpt", "--json")
    rows = {r["key"]: r for r in json.loads(out)["entries"]}
    assert code == 0 and rows["state['sd']"]["kind"] == "OrderedDict"
    assert rows["state['tied'][1]"]["shares_storage_with"] == "state['sd']['weight']"


def test_sizes_are_binary_except_decimal_kb_mb_gb() -> None:
    """``--shard-size 5GB`` is Hugging Face's 5·10⁹ bytes; ``GiB`` and a bare ``G`` binary."""
    from asyncckpt.cli.common import parse_bytes

    assert parse_bytes("5GB") == 5 * 10**9
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("5GiB") == parse_bytes("5g") == 5 << 30
    assert parse_bytes("64KiB") == 64 << 10
