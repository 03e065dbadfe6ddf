"""The parsers of the commands that read or write tensors (``inspect``, ``verify``,
``convert``, ``bench``), kept apart from their code so that ``asyncckpt --help`` and
``asyncckpt COMMAND --help`` return without importing torch (seconds): each parser's
``run`` imports its command module only when the command runs.
"""

from __future__ import annotations

from asyncckpt.cli.common import (
    FORMATS,
    Subparsers,
    add_max_bytes,
    new_command,
    parse_bytes,
)


def add_inspect(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "inspect",
        "show the keys, dtypes, shapes, sizes and codecs of a checkpoint",
        "Show what a checkpoint holds without reading its data: the key tree with dtypes, "
        "shapes, sizes, saved devices and codecs. PATH is an asyncckpt, torch.save "
        "(read with weights_only=True) or safetensors file, or an asyncckpt.dcp directory; "
        "ROOT alone means its latest version (plain or sharded).",
    )
    p.add_argument("target", metavar="PATH|ROOT[@STEP]")
    p.add_argument(
        "--depth", type=int, metavar="N", help="show keys down to depth N only (0: the root)"
    )
    p.add_argument(
        "--key",
        metavar="PREFIX",
        help="show only keys under PREFIX, e.g. --key model or --key model/layer1 "
        "(a /-separated path, as convert --key takes it)",
    )
    add_max_bytes(p, "fail on")


def add_verify(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "verify",
        "read a checkpoint and check every checksum",
        "Read every byte of a checkpoint and check every chunk's checksum and the whole "
        "structure. Exit status 0 only when everything is sound; each bad chunk is named "
        "with the keys it holds. PATH is an asyncckpt file or an asyncckpt.dcp directory; "
        "ROOT alone means its latest version (plain or sharded).",
    )
    p.add_argument("target", metavar="PATH|ROOT[@STEP]")
    p.add_argument("--all", action="store_true", help="verify every committed version of ROOT")
    add_max_bytes(p, "report as too large")


def add_convert(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "convert",
        "convert between torch.save, asyncckpt and safetensors files",
        "Convert a checkpoint between torch.save (.pt/.pth/.bin; read with "
        "weights_only=True), asyncckpt (.ackpt, or ROOT[@STEP]) and safetensors "
        "(.safetensors; a flat dict of tensors; tied weights are written once and tied "
        "again on the way back). The same tensors come out; a file's format is told by its "
        "first bytes, whatever its name. A sharded version (ROOT@STEP of a sharded "
        "Checkpointer) or an asyncckpt.dcp directory is consolidated into one file tensor "
        "by tensor: to .ackpt and .safetensors with memory bounded by the largest tensor; "
        "torch.save output holds the whole state. With --shard-size, DST is a folder of "
        "safetensors shards and model.safetensors.index.json (the layout "
        "transformers' from_pretrained reads), written one shard at a time.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--from", dest="src_format", choices=sorted(FORMATS), help="format of SRC")
    p.add_argument("--to", dest="dst_format", choices=sorted(FORMATS), help="format of DST")
    p.add_argument(
        "--key",
        metavar="A/B",
        help="convert only this part of the state, e.g. --key model (a /-separated path)",
    )
    p.add_argument(
        "--compression",
        choices=["zstd", "none"],
        default="zstd",
        help="for an asyncckpt DST (default zstd)",
    )
    p.add_argument(
        "--shard-size",
        type=parse_bytes,
        metavar="SIZE",
        help="write DST as a folder of safetensors files of at most SIZE each (e.g. 5GB; "
        "a larger tensor gets a file of its own) and model.safetensors.index.json",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    add_max_bytes(p, "refuse (an asyncckpt or sharded SRC)")


def add_cp(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "cp",
        "copy versions between stores in commit order, verified, resumable",
        "Copy the committed versions of a checkpoint root (ROOT@STEP: that one) to root DST "
        "(local disk, S3, any fsspec URL) as a save writes them: each version's data files "
        "first, each verified at DST (every checksum), then its COMMIT, then the version "
        "file, so that a reader of DST never sees a committed version whose data is not "
        "there, whenever the copy stops. Oldest first; a version already committed at DST "
        "with the same files is skipped, so rerunning completes an interrupted copy. No job "
        "may write DST meanwhile. The storage options apply to both sides.",
    )
    p.add_argument("src", metavar="SRC[@STEP]")
    p.add_argument("dst", metavar="DST")


def add_bench(sub: Subparsers) -> None:
    p = new_command(
        sub,
        "bench",
        "measure sync vs async save and load on your storage",
        "Save and load a random state with torch.save/torch.load and asyncckpt on URL (a "
        "directory or fsspec URL; a temporary folder is created in it and removed), print "
        "medians as ratios to a plain in-memory copy, and plot them.",
    )
    p.add_argument("url", metavar="URL")
    p.add_argument("--size-mib", type=float, default=256.0, help="state size (default 256)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement (default 3)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the state's tensors (default float32)",
    )
    p.add_argument(
        "--plot",
        default="asyncckpt-bench.png",
        metavar="PNG",
        help="where to write the plot (default ./asyncckpt-bench.png; needs matplotlib)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write a plot")
    p.add_argument("--keep", action="store_true", help="keep the files written on URL")
