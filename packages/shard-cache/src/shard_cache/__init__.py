"""shard_cache."""
