"""Exceptions that shard-cache raises for bad input and misuse; each message names the file and the fix."""


class ShardCacheError(Exception):
    """Base of every error shard-cache raises on purpose."""


class BadInputError(ShardCacheError):
    """An input document or file that cannot be used (malformed, missing field, unreadable)."""


class CacheLockedError(ShardCacheError):
    """Another live builder holds the cache directory's lock."""


class CacheMismatchError(ShardCacheError):
    """An existing cache was built with different settings than the ones asked for now."""


class CacheCorruptError(ShardCacheError):
    """A cache file is missing, unreadable, or fails its checksum."""
