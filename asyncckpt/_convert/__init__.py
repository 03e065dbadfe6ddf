"""_convert."""
