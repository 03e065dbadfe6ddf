"""A version's metrics: the small JSON metadata its ``COMMIT`` record carries.

``Checkpointer.save(step, state, metrics={"eval_loss": 0.31})`` stores them with the version
so that retention (keep the best K by a metric) and ``asyncckpt ls`` read them without
loading the state. They are validated twice with the same rule: when saved (the caller's
error names the key) and when a ``COMMIT`` is read (a record that breaks it is malformed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from asyncckpt.errors import InvalidMetricsError

#: At most this many metrics per version.
MAX_METRICS = 64
#: A metric's name is at most this many characters.
MAX_NAME = 128
#: A string value is at most this many characters.
MAX_STRING = 256
#: The metrics' JSON is at most this many bytes (the whole COMMIT record stays small).
MAX_METRICS_BYTES = 16 << 10

Metrics = dict[str, "float | int | str"]


def check_metrics(metrics: Any, where: str = "metrics") -> Metrics:
    """Validate a version's metrics and return them as a new plain dict.

    Values are finite ints or floats (not bools; 0-d tensors and numpy scalars are taken
    with ``.item()``) or strings of at most :data:`MAX_STRING`
    characters; names are non-empty strings of at most :data:`MAX_NAME` characters; at
    most :data:`MAX_METRICS` entries and :data:`MAX_METRICS_BYTES` of JSON in all. An
    error names ``where`` (the checkpoint and step, or ``metrics``).

    Raises:
        InvalidMetricsError: the metrics break a rule; the message names the key.

    Example:
        >>> check_metrics({"eval_loss": 0.31, "tag": "warmup"})
        {'eval_loss': 0.31, 'tag': 'warmup'}
    """
    if not isinstance(metrics, Mapping):
        raise InvalidMetricsError(f"{where}: must be a dict, got {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS:
        raise InvalidMetricsError(f"{where}: {len(metrics)} entries; at most {MAX_METRICS}")
    out: Metrics = {}
    for key, value in metrics.items():
        _check_name(key, where)
        out[key] = _check_value(key, value, where)
    size = len(json.dumps(out).encode())
    if size > MAX_METRICS_BYTES:
        raise InvalidMetricsError(
            f"{where}: {size} bytes of JSON; at most {MAX_METRICS_BYTES} (metrics are small "
            "metadata: save large values in the state)"
        )
    return out


def _check_name(key: Any, where: str) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidMetricsError(f"{where}: the name {key!r} is not a non-empty string")
    if len(key) > MAX_NAME:
        raise InvalidMetricsError(
            f"{where}: the name {key[:32]!r}... has {len(key)} characters; at most {MAX_NAME}"
        )


def _check_value(key: str, value: Any, where: str) -> float | int | str:
    value = _as_number(key, value, where)
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise InvalidMetricsError(
                f"{where}: {key!r} is a string of {len(value)} characters; at most {MAX_STRING}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidMetricsError(
            f"{where}: {key!r} is {type(value).__name__}; a metric is a finite number or a "
            "short string"
        )
    try:  # an int is ranked as a float: one too large for it would raise OverflowError there
        finite = math.isfinite(value)
    except OverflowError:
        raise InvalidMetricsError(
            f"{where}: {key!r} is an integer of {len(str(abs(int(value))))} digits; a metric must "
            "fit in a float"
        ) from None
    if not finite:
        raise InvalidMetricsError(f"{where}: {key!r} is {value!r}; a metric must be finite")
    return int(value) if isinstance(value, int) else float(value)  # numpy/torch subclasses


def _as_number(key: str, value: Any, where: str) -> Any:
    """A 0-d tensor or numpy scalar (``loss.detach()``, ``np.float32``) as its Python
    number, by ``.item()``, as training loops log them; anything else as it is.

    Duck-typed (``shape == ()`` and ``item``), so that this module imports no torch.
    """
    item = getattr(value, "item", None)
    shape = getattr(value, "shape", None)
    if isinstance(value, (str, int, float)) or not callable(item) or shape is None:
        return value
    if tuple(shape) != ():
        raise InvalidMetricsError(
            f"{where}: {key!r} has shape {tuple(shape)}; a metric is one number (a 0-d "
            "tensor is taken with .item())"
        )
    return item()
