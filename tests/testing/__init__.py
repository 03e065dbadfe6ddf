"""Tests of the test kit itself (asyncckpt/testing): servers, fault injection."""
