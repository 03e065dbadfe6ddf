"""Tests of save/load/Checkpointer (asyncckpt/_api), in one process and across processes."""
