"""Tests of the engine (asyncckpt/_engine): arena, writer, writer process, compression, CUDA."""
