"""Sharding by axis name: logical-to-mesh mappings, shard, infer_sharding and named_jit."""

__all__: list[str] = []
