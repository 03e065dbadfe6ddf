"""Tests of storage backends (asyncckpt/_storage): local, fsspec, S3, conformance."""
