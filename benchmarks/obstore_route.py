"""Route ``s3://`` URLs to the obstore prototype (issue 30's measurement), in this process.

Imported by ``bench_obstore.py`` and by its fresh-process children: after
:func:`use_obstore`, ``asyncckpt.save``/``load`` of an ``s3://`` URL go through
:class:`obstore_backend.ObstoreS3Storage` instead of s3fs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def use_obstore() -> Callable[[], None]:
    """Replace ``resolve`` in every loaded asyncckpt module by one that sends ``s3://`` to
    obstore (storage options as s3fs takes them); other URLs are resolved as before.
    Returns the function that puts the original back.

    Example:
        >>> undo = use_obstore()
        >>> import asyncckpt._versions.paths as p
        >>> type(p.resolve("s3://b/k", {"endpoint_url": "http://127.0.0.1:9"})[0]).__name__
        'ObstoreS3Storage'
        >>> undo()
    """
    from obstore_backend import ObstoreS3Storage

    import asyncckpt._storage as storage
    import asyncckpt._versions.paths  # noqa: F401  (save and load resolve through it)
    from asyncckpt._settings import Settings

    original = storage.resolve

    def resolve(f: Any, storage_options: Any, settings: Settings | None = None) -> Any:
        text = os.fspath(f)
        if not text.startswith("s3://"):
            return original(f, storage_options, settings)
        store = ObstoreS3Storage(storage_options, settings=settings or Settings.resolve())
        return store, text.removeprefix("s3://")

    patched = [m for m in list(sys.modules.values()) if getattr(m, "resolve", None) is original]
    for module in patched:
        module.resolve = resolve  # type: ignore[attr-defined]

    def undo() -> None:
        for module in patched:
            module.resolve = original  # type: ignore[attr-defined]

    return undo
