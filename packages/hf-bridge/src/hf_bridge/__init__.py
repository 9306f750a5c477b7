"""hf_bridge."""
