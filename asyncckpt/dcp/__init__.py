"""A ``torch.distributed.checkpoint`` storage backend that writes asyncckpt files.

Switch DCP (and torchtitan, which calls DCP) to asyncckpt's storage with one argument::

    dcp.save(state, storage_writer=asyncckpt.dcp.Writer(url))
    dcp.async_save(state, storage_writer=asyncckpt.dcp.Writer(url))
    dcp.load(state, storage_reader=asyncckpt.dcp.Reader(url))

Each rank writes one file in asyncckpt's format (compressed, a CRC-32 per chunk, atomic);
the coordinator commits by creating a JSON metadata object with an exclusive create once
every rank's file is durable. Loading never unpickles the metadata and verifies every chunk
it reads. ``docs/sharded.md`` describes the layout and the commit rule.
"""

from asyncckpt._format.index import METADATA_NAME, ItemLocation
from asyncckpt._versions.dcp_reader import Reader
from asyncckpt.dcp.writer import Writer

__all__ = ["METADATA_NAME", "ItemLocation", "Reader", "Writer"]
