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


_OS_HINTS = {
    "ENOSPC": "free space on that filesystem or point LLM_PIPELINE_VAR_DIR / --run-dir elsewhere",
    "EDQUOT": "free space (disk quota exceeded) or point LLM_PIPELINE_VAR_DIR / --run-dir elsewhere",
    "EROFS": "the filesystem is read-only: point LLM_PIPELINE_VAR_DIR / --run-dir at a writable directory",
    "EACCES": "make it writable/readable for this user or point LLM_PIPELINE_VAR_DIR / --run-dir elsewhere",
    "EPERM": "make it writable/readable for this user or point LLM_PIPELINE_VAR_DIR / --run-dir elsewhere",
    "EEXIST": "a file is in the way of a directory: remove it or choose another path",
    "ENOTDIR": "a file is in the way of a directory: remove it or choose another path",
    "EISDIR": "a directory where a file was expected: check the path",
    "ENOENT": "check the path",
    "EMFILE": "too many open files: raise `ulimit -n`",
}


def os_error_cause(e: OSError) -> str:
    """One line for an OS error: the path(s), what the errno means, its symbol and the usual fix."""
    import errno as _errno

    name = _errno.errorcode.get(e.errno or 0, "")
    what = e.strerror or str(e) or type(e).__name__
    paths = " → ".join(str(p) for p in (e.filename, e.filename2) if p)
    hint = _OS_HINTS.get(name, "")
    return f"{paths + ': ' if paths else ''}{what}{f' ({name})' if name else ''}{'; ' + hint if hint else ''}"
