"""lm_models."""
