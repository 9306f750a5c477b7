"""Errors that the CLI shows as one clear paragraph and exit code 2, without a traceback."""


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, flag) that they can fix."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, key, value or override is wrong."""


class DataError(UserError):
    """Training or validation data is missing or unreadable."""


class CheckpointError(UserError):
    """A checkpoint is missing, torn, or does not fit the model."""


class ExportError(UserError):
    """An export does not read back as the checkpoint it was made from."""
