"""HfBridgeError: the one exception type for bad input (files, keys, configs) that users can fix."""


class HfBridgeError(Exception):
    """A checkpoint, config or tokenizer that hf_bridge cannot use; the message names the file or key and the fix."""
