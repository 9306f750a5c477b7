"""lm_train."""
