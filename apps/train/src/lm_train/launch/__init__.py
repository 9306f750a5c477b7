"""Launching one run on many hosts through an engine's own mechanism (Ray today), and keeping it alive."""
