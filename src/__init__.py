"""headrace: a single-node serving daemon for compound-AI workflows."""

__version__ = "0.1.0"
