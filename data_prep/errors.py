"""One-line errors for bad inputs (tasks/stages/shard.py turns them into StageError), and the command lines' parser
that says a mistyped flag in one line too."""

import argparse


class DataPrepError(ValueError):
    """A bad input or configuration; the message is always one line."""

    def __init__(self, cause: str):
        super().__init__(" ".join(str(cause).split()))


class CorruptShardError(DataPrepError):
    """A shard is missing, truncated or does not match its manifest entry; the message names the shard."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, but a bad flag or value is one line (`error: <prog>: unrecognized arguments: --stpes (…
    --help lists the flags)`, exit 2), not its usage block: every command of ours says a bad input in one line.
    Sub-commands' parsers are of this class too (add_subparsers makes them of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())} (`{self.prog} --help` lists the flags)\n")
