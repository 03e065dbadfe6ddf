"""Tests of the benchmarks run and write well-formed results (benchmarks/)."""
