"""_format."""
