"""dist_ckpt."""
