"""Errors that carry a one-line cause for the operator (CLI prints it; the DAG fails the task with it)."""


class StageError(Exception):
    """A stage failed for a reason the operator can act on.

    `retryable` tells the orchestrator whether a plain retry can succeed (a rank died mid-training and the
    retry resumes from the last checkpoint) or not (bad input: retrying changes nothing).
    """

    def __init__(self, cause: str, *, retryable: bool = False):
        super().__init__(" ".join(str(cause).split()))  # one line, always
        self.retryable = retryable


class ConfigError(StageError):
    """The configuration is invalid; each problem is one line of the message."""

    def __init__(self, problems):
        problems = [problems] if isinstance(problems, str) else list(problems)
        self.problems = problems
        Exception.__init__(self, "; ".join(problems))
        self.retryable = False
