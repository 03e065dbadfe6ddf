"""Chunk codecs: raw, zstd, and byte-grouped zstd for floating-point data (docs/FORMAT.md
§8, which says why byte grouping pays and which codec the writer picks).

Before a plane is compressed whole, a probe compresses three small samples of it; with
``"zstd"`` every plane that shrinks by 2 % or more is compressed, with ``"auto"`` the planes
the caller chose (the cost model lives with its measurements, in
:mod:`asyncckpt._engine.autocompress`).

Functions here are pure (bytes in, bytes out) and safe to call from many threads: zstandard
releases the GIL while it works.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import thread_time

import numpy as np
import zstandard
from zlib_ng import zlib_ng

from asyncckpt.errors import FormatError

COMPRESSIONS = ("none", "zstd", "auto")

#: A plane whose probe keeps more than this fraction of its bytes is not worth compressing.
INCOMPRESSIBLE = 0.98

#: ``choose(width, ratios)``: which of a chunk's ``width`` planes to compress, given the
#: probe's estimate of stored/raw for each (None: the plane is too short to sample).
PlaneChooser = Callable[[int, tuple[float | None, ...]], Sequence[bool]]

_local = threading.local()


def _compressor(level: int, plane: bool = False) -> zstandard.ZstdCompressor:
    """A per-thread compressor for ``level``; ``plane`` selects the byte-plane tuning."""
    cache: dict[tuple[int, bool], zstandard.ZstdCompressor]
    cache = _local.__dict__.setdefault("cctx", {})
    key = (level, plane and level == 1)
    if key not in cache:
        if key[1]:
            params = zstandard.ZstdCompressionParameters(**_PLANE_PARAMS)
            cache[key] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[key] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[key]


#: zstd settings for byte planes at the default level 1, measured on fp32/bf16 weights: a
#: sign/exponent plane has few long matches and a skewed byte histogram, so a tiny hash
#: table and a minimum match of 7 spend the time on entropy coding instead of match
#: search. Against plain level 1 this stores 0.335 instead of 0.366 of an N(0, 1) fp32
#: exponent plane, at 0.84 instead of 0.31 GB/s (one core). Other levels use zstd's own.
_PLANE_PARAMS = {
    "window_log": 17,
    "hash_log": 6,
    "chain_log": 6,
    "search_log": 1,
    "min_match": 7,
    "target_length": 0,
    "strategy": zstandard.STRATEGY_FAST,
    "write_content_size": True,
}


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def check_compression(compression: str) -> str:
    """Validate a user's ``compression`` argument and return it.

    Raises:
        ValueError: not one of :data:`COMPRESSIONS`.

    Example:
        >>> check_compression("auto")
        'auto'
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    return compression


@dataclass
class EncodeReport:
    """What encoding one chunk cost and found; :func:`encode_chunk` fills it in.

    Times are CPU seconds of the encoding thread, whatever else runs beside it (whether
    that CPU was idle is measured apart: :func:`asyncckpt._cpu.spare_cores`).

    Attributes:
        group_s: CPU seconds spent regrouping the chunk's bytes into planes.
        grouped_bytes: bytes regrouped (0: the chunk was not regrouped).
        compress_s: CPU seconds spent compressing whole planes (probes not included).
        compressed_bytes: raw bytes of the planes compressed whole.
        ratios: per plane, stored/raw: exact for a plane compressed whole, else the probe's
            estimate, else None.

    Example:
        >>> report = EncodeReport()
        >>> _ = encode_chunk(memoryview(bytes(4096)), itemsize=4, is_float=True,
        ...                  compression="zstd", level=1, report=report)
        >>> report.grouped_bytes, report.compressed_bytes, report.ratios[0] < 0.1
        (4096, 4096, True)
    """

    group_s: float = 0.0
    grouped_bytes: int = 0
    compress_s: float = 0.0
    compressed_bytes: int = 0
    ratios: tuple[float | None, ...] = ()


def shrinks(width: int, ratios: Sequence[float | None]) -> tuple[bool, ...]:
    """``compression="zstd"``: compress every plane the probe does not find incompressible."""
    return tuple(r is None or r <= INCOMPRESSIBLE for r in ratios)


def encode_chunk(
    raw: memoryview,
    *,
    itemsize: int,
    is_float: bool,
    compression: str,
    level: int,
    choose: PlaneChooser | None = None,
    report: EncodeReport | None = None,
) -> tuple[str, bytes | memoryview]:
    """Encode one chunk: ``(codec, stored_bytes)``, ``raw`` itself for the raw codec.

    Floating-point data (``is_float``) is byte-grouped, ``itemsize`` bytes wide. With
    ``"auto"``, ``choose`` decides from the probe which planes to compress (a chunk that is
    not byte-grouped is one plane); without it, ``"auto"`` compresses what ``"zstd"`` would.
    ``report``, if given, is filled in with what the encoding cost and found.

    Example:
        >>> codec, stored = encode_chunk(memoryview(bytes(4096)), itemsize=4, is_float=True,
        ...                              compression="zstd", level=1)
        >>> codec, len(stored) < 4096
        ('zstd-bytegroup', True)
    """
    if compression == "none" or len(raw) == 0:
        return "raw", raw
    report = EncodeReport() if report is None else report
    chooser = choose if compression == "auto" and choose is not None else shrinks
    stored: bytes | memoryview | None
    if is_float and itemsize > 1 and len(raw) % itemsize == 0:
        codec, stored = "zstd-bytegroup", _encode_planes(raw, itemsize, level, chooser, report)
    elif compression == "auto":
        codec, stored = "zstd", _encode_whole(raw, level, chooser, report)
    else:
        codec, stored = "zstd", _compressor(level).compress(raw)
    if stored is None or len(stored) >= len(raw):
        return "raw", raw
    return codec, stored


def _encode_planes(
    raw: memoryview, itemsize: int, level: int, choose: PlaneChooser, report: EncodeReport
) -> memoryview | None:
    """Group bytes by position, then compress the chosen planes, each alone: the payload, or
    None when no plane was chosen (then nothing was regrouped). See docs/FORMAT.md §8.3.

    The planes are grouped into the payload's own buffer, behind room for the plane table,
    and the payload is compacted in place: only frames, and raw planes behind a frame, are
    moved. Joining the parts into new bytes instead copied the whole chunk while holding the
    GIL (a third of the GIL a threaded save held beside a busy Python thread).
    """
    ratios = _probe_planes(raw, itemsize, level)
    wanted = choose(itemsize, ratios)
    report.ratios = ratios
    if not any(wanted):
        return None
    head, plane = 4 * itemsize, len(raw) // itemsize
    started = thread_time()
    payload = memoryview(np.empty(head + len(raw), dtype=np.uint8))  # type: ignore[arg-type]
    group_bytes(raw, itemsize, payload[head:])
    report.group_s, report.grouped_bytes = thread_time() - started, len(raw)
    planes = [payload[head + j * plane : head + (j + 1) * plane] for j in range(itemsize)]
    chosen = [j for j in range(itemsize) if wanted[j]]
    frames = dict(zip(chosen, _compress([planes[j] for j in chosen], level, report)))
    report.ratios = tuple(
        len(frames[j]) / plane if j in frames else r for j, r in enumerate(ratios)
    )
    lengths, end = [], head
    for j, grouped in enumerate(planes):
        frame = frames.get(j)
        part = frame if frame is not None and len(frame) < plane else grouped
        if part is not grouped or end != head + j * plane:
            payload[end : end + len(part)] = part  # memmove: the regions may overlap
        lengths.append(len(part))
        end += len(part)
    payload[:head] = struct.pack(f"<{itemsize}I", *lengths)
    return payload[:end]


def _encode_whole(
    raw: memoryview, level: int, choose: PlaneChooser, report: EncodeReport
) -> bytes | memoryview | None:
    """``"auto"`` for a chunk that is not byte-grouped: probe it, then maybe compress it."""
    ratio = _probe_ratio(raw, level, plane=False)
    report.ratios = (ratio,)
    if not choose(1, (ratio,))[0]:
        return None
    (packed,) = _compress([raw], level, report, plane=False)
    report.ratios = (len(packed) / len(raw),)
    return packed


def _compress(
    parts: list[memoryview], level: int, report: EncodeReport, plane: bool = True
) -> list[bytes | memoryview]:
    started = thread_time()
    packed = compress_frames(_compressor(level, plane), parts)
    report.compress_s += thread_time() - started
    report.compressed_bytes += sum(len(p) for p in parts)
    return packed


def compress_frames(
    cctx: zstandard.ZstdCompressor, parts: Sequence[memoryview]
) -> list[bytes | memoryview]:
    """Compress each of ``parts`` into its own frame, releasing the GIL once for all.

    Every zstd call releases the GIL and takes it back; a background encoder that takes it
    back while the training thread runs Python waits up to the switch interval (5 ms) each
    time. One call for a chunk's frames instead of one per frame cut a 16 MiB fp32 chunk's
    probe from 74 ms to 10 ms beside a busy Python thread (0.4 ms alone). The frames are
    the bytes ``cctx.compress`` would give; backends without the batch call (cffi) get those.

    Example:
        >>> frames = compress_frames(zstandard.ZstdCompressor(), [memoryview(bytes(64))] * 2)
        >>> [len(f) < 64 for f in frames]
        [True, True]
    """
    batch = getattr(cctx, "multi_compress_to_buffer", None)
    if batch is not None and len(parts) > 1 and all(len(p) for p in parts):  # it refuses empties
        with contextlib.suppress(NotImplementedError):  # cffi declares the method, lacks it
            frames = batch(list(parts), threads=1)
            return [memoryview(frames[i]) for i in range(len(frames))]  # views keep it alive
    return [cctx.compress(p) for p in parts]


#: Planes longer than this are probed on a sample before being compressed whole.
_PROBE_BYTES = 64 << 10


def _probe_ratio(data: memoryview, level: int, plane: bool = True) -> float | None:
    """stored/raw of samples from the start, middle and end of ``data`` (None: too short).

    Low mantissa bytes of floats are close to random; compressing them whole costs as much
    CPU as the useful planes and saves nothing, so a few spread samples decide.
    """
    if len(data) < 8 * _PROBE_BYTES:
        return None
    step, half = (len(data) - _PROBE_BYTES) // 2, _PROBE_BYTES // 2
    cctx = _compressor(level, plane)
    packed = sum(len(cctx.compress(data[k * step : k * step + half])) for k in range(3))
    return packed / (3 * half)


def _probe_planes(raw: memoryview, itemsize: int, level: int) -> tuple[float | None, ...]:
    """:func:`_probe_ratio` of every byte plane of ``raw``, without regrouping all of it.

    The samples are the ones the probe would take from each grouped plane: element ranges
    at the start, middle and end, regrouped alone (a few hundred KiB instead of the chunk).
    """
    plane = len(raw) // itemsize
    if plane < 8 * _PROBE_BYTES:
        return (None,) * itemsize
    step, half = (plane - _PROBE_BYTES) // 2, _PROBE_BYTES // 2
    # The three element ranges as one (3, half, itemsize) view, regrouped by one copy into
    # (itemsize, 3, half): plane j's samples side by side, one numpy call for all of them.
    elements = np.frombuffer(raw, dtype=np.uint8)
    ranges = np.lib.stride_tricks.as_strided(
        elements, shape=(3, half, itemsize), strides=(step * itemsize, itemsize, 1), writeable=False
    )
    grouped = ranges.transpose(2, 0, 1).copy()
    samples = [memoryview(grouped[j, k]) for j in range(itemsize) for k in range(3)]
    sizes = [len(f) for f in compress_frames(_compressor(level, True), samples)]
    return tuple(sum(sizes[3 * j : 3 * j + 3]) / (3 * half) for j in range(itemsize))


def decode_chunk(stored: bytes | memoryview, codec: str, itemsize: int, out: memoryview) -> None:
    """Decode one chunk into ``out``, which must be exactly the chunk's raw length.

    Raises:
        FormatError: the payload does not decompress to exactly ``len(out)`` bytes.
    """
    if codec == "raw":
        if len(stored) != len(out):
            raise FormatError(f"raw chunk holds {len(stored)} bytes, expected {len(out)}")
        out[:] = stored
        return
    if codec == "zstd-bytegroup":
        scratch = _scratch(len(out))
        _decode_planes(stored, itemsize, scratch)
        ungroup_bytes(scratch, itemsize, out)
    else:
        _decompress_into(stored, out)


def _decode_planes(stored: bytes | memoryview, itemsize: int, out: memoryview) -> None:
    """Inverse of :func:`_encode_planes` before ungrouping: fill ``out`` plane by plane."""
    if len(out) % itemsize:
        raise FormatError(f"byte-grouped chunk of {len(out)} bytes is not a multiple of {itemsize}")
    plane, head = len(out) // itemsize, 4 * itemsize
    if len(stored) < head:
        raise FormatError(f"byte-grouped chunk of {len(stored)} bytes has no plane table")
    lengths = struct.unpack_from(f"<{itemsize}I", stored)
    if any(n > plane for n in lengths) or head + sum(lengths) != len(stored):
        raise FormatError(f"byte-grouped chunk's plane lengths {lengths} do not add up")
    view, pos = memoryview(stored), head
    for j, n in enumerate(lengths):
        dst = out[j * plane : (j + 1) * plane]
        if n == plane:  # stored raw: a zstd frame is only kept when strictly shorter
            dst[:] = view[pos : pos + n]
        else:
            _decompress_into(view[pos : pos + n], dst)
        pos += n


def _scratch(size: int) -> memoryview:
    """A per-thread buffer of ``size`` bytes, reused across chunks to avoid page faults."""
    buf: bytearray | None = getattr(_local, "scratch", None)
    if buf is None or len(buf) < size:
        buf = _local.scratch = bytearray(size)
    return memoryview(buf)[:size]


def _decompress_into(stored: bytes | memoryview, out: memoryview) -> None:
    """Decompress one zstd frame straight into ``out``; it must fill ``out`` exactly."""
    try:
        # zstandard allocates the size a frame header declares, whatever max_output_size says.
        declared = zstandard.frame_content_size(stored)
        if declared not in (-1, len(out)):
            raise FormatError(f"zstd frame declares {declared} bytes, expected {len(out)}")
        reader = _decompressor().stream_reader(stored)
        done = 0
        while done < len(out):
            n = reader.readinto(out[done:])
            if not n:
                break
            done += n
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd payload does not decompress: {exc}") from exc
    if done != len(out) or extra:
        raise FormatError(
            f"chunk decompressed to {done if not extra else 'more than'} "
            f"{'' if not extra else str(len(out)) + ' '}bytes, expected {len(out)}"
        )


def group_bytes(
    raw: memoryview | bytes, itemsize: int, out: memoryview | None = None
) -> memoryview:
    """Regroup element bytes by position: ``b0 b0 b0 … b1 b1 b1 …``, into ``out`` if given
    (exactly ``len(raw)`` bytes), else into a new buffer; returns it."""
    if out is None:
        out = memoryview(np.empty(len(raw), dtype=np.uint8))  # type: ignore[arg-type]
    grid = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize)
    np.frombuffer(out, dtype=np.uint8).reshape(itemsize, -1)[...] = grid.T
    return out


def ungroup_bytes(grouped: bytes | memoryview, itemsize: int, out: memoryview) -> None:
    """Inverse of :func:`group_bytes`, written straight into ``out``."""
    src = np.frombuffer(grouped, dtype=np.uint8).reshape(itemsize, -1)
    dst = np.frombuffer(out, dtype=np.uint8).reshape(-1, itemsize)
    # One contiguous-source column at a time is several times faster than dst[...] = src.T.
    for j in range(itemsize):
        dst[:, j] = src[j]


def checksum(data: bytes | memoryview) -> int:
    """CRC-32 (zlib's polynomial) of ``data``; releases the GIL on large inputs.

    zlib-ng's CRC-32 (carry-less multiplication) gives zlib's values at about 10x the speed
    of the system zlib that Python links (4 GB/s on this project's machines), which made
    the checksum a visible share of every save and load.

    Example:
        >>> checksum(b"asyncckpt") == __import__("zlib").crc32(b"asyncckpt")
        True
    """
    return zlib_ng.crc32(data)
