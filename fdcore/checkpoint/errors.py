"""The one error of reading checkpoints."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, with the file and the reason."""
