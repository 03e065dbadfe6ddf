"""Tests of versioned roots (asyncckpt/_versions): deletion, markers, retention, roles."""
