"""Tests of the format (asyncckpt/_format) and what a crafted file can make a reader do."""
