"""_versions."""
