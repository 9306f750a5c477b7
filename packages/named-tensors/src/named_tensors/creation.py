"""Arrays built from axes: zeros, ones, full, arange and the *_like forms."""

__all__: list[str] = []
