"""One-line errors for bad inputs (tasks/stages/shard.py turns them into StageError)."""


class DataPrepError(ValueError):
    """A bad input or configuration; the message is always one line."""

    def __init__(self, cause: str):
        super().__init__(" ".join(str(cause).split()))


class CorruptShardError(DataPrepError):
    """A shard is missing, truncated or does not match its manifest entry; the message names the shard."""
