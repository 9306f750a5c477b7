"""Typed configuration of a training run: schema, YAML loading, overrides."""
