"""raycompat."""
