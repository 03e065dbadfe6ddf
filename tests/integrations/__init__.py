"""Tests of integrations: DCP, Lightning, Hugging Face, torchtitan, conversion."""
