"""Tests of the test kit itself: asyncckpt/testing (fault injection, crash points) and the
S3 test doubles in tests/ (servers, proxy)."""
