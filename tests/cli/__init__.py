"""Tests of the asyncckpt command line (asyncckpt/cli)."""
