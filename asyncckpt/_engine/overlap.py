"""Guards for ``overlap=True``: make every in-place update wait for the snapshot's copies.

With overlap, ``save`` returns while device-to-host copies may still be reading the saved
tensors. Anything that writes those tensors in place before the copies land tears the
snapshot. That is not only ``optimizer.step``: a training-mode forward updates BatchNorm's
``running_mean``/``running_var``/``num_batches_tracked``, and ``GradScaler.update`` rewrites
its scale. :func:`guard` installs a hook in front of each of those writers that calls
``wait`` (e.g. ``Snapshot.wait_copied``) first; ``wait`` is cheap once the copies landed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

Wait = Callable[[], None]

#: GradScaler methods that write its state (scale, growth tracker) or the gradients.
_SCALER_METHODS = ("unscale_", "update")


class _Removable(Protocol):
    def remove(self) -> None: ...


class GuardHandle:
    """Undoes a :func:`guard`; ``remove`` is idempotent. Also a context manager.

    Example:
        >>> handle = guard(torch.nn.Linear(1, 1), lambda: None)
        >>> handle.remove()
        >>> handle.remove()  # a second call does nothing
    """

    def __init__(self, parts: list[_Removable]) -> None:
        self._parts = parts

    def remove(self) -> None:
        """Remove every hook and wrapper this guard installed."""
        parts, self._parts = self._parts, []
        for part in reversed(parts):
            part.remove()

    def __enter__(self) -> GuardHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def guard(target: Any, wait: Wait) -> GuardHandle:
    """Make ``target``'s in-place updates call ``wait()`` before they write.

    Args:
        target: a ``torch.optim.Optimizer`` (a step pre-hook), a ``torch.nn.Module`` (a
            forward pre-hook on that module, run before its other hooks; it covers the
            buffers its submodules update during its forward, so a submodule that is also
            called on its own must be passed too: hooks on every submodule would cost
            each forward far more), a ``torch.amp.GradScaler`` (its ``unscale_`` and
            ``update`` wrapped on the instance), or a list/tuple of these, nested freely.
        wait: blocks until the last snapshot's copies have landed.

    Returns:
        One handle whose ``remove()`` undoes everything installed.

    Raises:
        TypeError: a target is none of the kinds above (nothing is installed then).

    Example:
        >>> calls = []
        >>> model = torch.nn.BatchNorm1d(2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> handle = guard([model, opt], lambda: calls.append("wait"))
        >>> model(torch.randn(4, 2)).sum().backward()
        >>> opt.step()
        >>> calls
        ['wait', 'wait']
        >>> handle.remove()
    """
    targets = list(_targets(target))  # check every target before installing anything
    parts: list[_Removable] = []
    for item in targets:
        parts.extend(_install(item, wait))
    return GuardHandle(parts)


def _targets(target: Any) -> Iterable[Any]:
    if isinstance(target, (list, tuple)):
        for item in target:
            yield from _targets(item)
    elif isinstance(target, (torch.optim.Optimizer, torch.nn.Module, torch.amp.GradScaler)):
        yield target
    else:
        raise TypeError(
            "guard() takes an Optimizer, a Module, a GradScaler or a list/tuple of them, "
            f"not {type(target).__qualname__}"
        )


def _install(target: Any, wait: Wait) -> list[_Removable]:
    if isinstance(target, torch.optim.Optimizer):
        return [target.register_step_pre_hook(lambda *_: wait())]
    if isinstance(target, torch.nn.Module):
        return [target.register_forward_pre_hook(lambda *_: wait(), prepend=True)]
    return [_Wrapper(target, name, wait) for name in _SCALER_METHODS]


class _Wrapper:
    """An instance attribute shadowing ``obj.name`` that calls ``wait()`` first."""

    def __init__(self, obj: Any, name: str, wait: Wait) -> None:
        self._obj, self._name = obj, name
        self._had_own = name in vars(obj)
        self._previous = vars(obj).get(name)
        method = getattr(obj, name)
        self._active = True

        @functools.wraps(method)
        def waiting(*args: Any, **kwargs: Any) -> Any:
            if self._active:
                wait()
            return method(*args, **kwargs)

        waiting.__dict__["_asyncckpt_guard"] = self
        self._installed = waiting
        setattr(obj, name, waiting)

    def remove(self) -> None:
        # Another wrapper may sit over this one: then only disarm, so that its call still
        # reaches the method; it unwinds this one too when it is removed.
        self._active = False
        if vars(self._obj).get(self._name) is not self._installed:
            return
        wrapper = self
        while wrapper._had_own:
            below = getattr(wrapper._previous, "_asyncckpt_guard", None)
            if not isinstance(below, _Wrapper) or below._active:
                setattr(self._obj, self._name, wrapper._previous)
                return
            wrapper = below
        delattr(self._obj, self._name)
