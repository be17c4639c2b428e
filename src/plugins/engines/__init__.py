"""plugins/engines."""
