"""trackers."""
