"""Shared pieces of the parser fuzz tests: strategies, settings, a memory limit.

Every parser of bytes that come from storage is fed valid records with fields replaced by
arbitrary JSON, cut short, spliced, or arbitrary bytes; the tests assert that only
:class:`~asyncckpt.errors.AsyncCkptError` subclasses escape (readers that document
"absent or unreadable" return None), under an address-space limit so that a parser that
allocates what a crafted length asks for fails the test instead of the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

#: Bounded, reproducible: the same examples every run (no database, derandomized). A deeper
#: hunt outside ``make test``: ``FUZZ_EXAMPLES=5000 pytest tests/*/test_fuzz_*.py`` draws that many
#: examples per test, new ones on every run (hypothesis prints how to replay a failure);
#: ``tests/versions/test_interleavings.py`` takes it too.
DEEP_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=DEEP_EXAMPLES or 150,
    deadline=None,
    derandomize=not DEEP_EXAMPLES,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def draw_no_literals_of_this_project() -> None:
    """Keep hypothesis from drawing the literals it finds in this project's imported modules
    (run at start-up by ``tests/conftest.py``, unless ``FUZZ_EXAMPLES`` asks for a hunt).

    Which modules a pytest worker has imported depends on the tests it ran before, so with
    them the same derandomized test drew other examples from one run to the next: a failure
    in ``make test`` could not be replayed. Hypothesis has no setting for it (6.170).
    """
    if DEEP_EXAMPLES:
        return
    from hypothesis.internal.conjecture import providers

    providers.is_local_module_file = lambda path: False


#: Address space a parser may take on top of what the process already has.
HEADROOM_BYTES = 2 << 30

#: Integers a crafted record tends to hold: edges of every width, negatives, huge.
EDGE_INTS = st.sampled_from(
    [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]
)
JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | EDGE_INTS
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (the root included)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {**doc, head: _replace(doc[head], rest, value)}
    copy = list(doc)
    copy[head] = _replace(doc[head], rest, value)
    return copy


@st.composite
def mutated_json(draw: st.DrawFn, base: Any, max_changes: int = 3) -> Any:
    """``base`` with 1..``max_changes`` places replaced by arbitrary JSON (or a key added)."""
    doc = base
    for _ in range(draw(st.integers(1, max_changes))):
        path = draw(st.sampled_from(_paths(doc)))
        if draw(st.booleans()):
            doc = _replace(doc, path, draw(JSON_VALUES | EDGE_INTS))
        else:
            target: Any = doc
            for p in path:
                target = target[p]
            if isinstance(target, dict):
                key = draw(st.text(max_size=8))
                doc = _replace(doc, path, {**target, key: draw(JSON_VALUES)})
            elif isinstance(target, list) and target:
                doc = _replace(doc, path, target[: draw(st.integers(0, len(target) - 1))])
    return doc


def record_bytes(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """A record's bytes: mutated JSON, a valid record cut or spliced, or arbitrary bytes."""
    valid = json.dumps(base).encode()
    mutated = mutated_json(base).map(lambda d: json.dumps(d).encode())

    @st.composite
    def damaged(draw: st.DrawFn) -> bytes:
        raw = draw(mutated | st.just(valid))
        cut = draw(st.integers(0, len(raw)))
        return raw[:cut] + draw(st.binary(max_size=8)) + raw[cut + draw(st.integers(0, 4)) :]

    return mutated | damaged() | st.binary(max_size=64)


@contextlib.contextmanager
def memory_limited(headroom: int = HEADROOM_BYTES) -> Iterator[None]:
    """Lower this process's address-space limit to what it uses now plus ``headroom``.

    The soft limit only: it is raised back afterwards (an unprivileged process may raise
    its soft limit up to the hard one).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    limit = used + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def only_asyncckpt_errors(call: Callable[[], Any]) -> Any:
    """``call()``'s result, or None if it raised an asyncckpt error; anything else escapes
    (the test then fails with it and hypothesis shrinks the input)."""
    from asyncckpt.errors import AsyncCkptError

    try:
        return call()
    except AsyncCkptError:
        return None
