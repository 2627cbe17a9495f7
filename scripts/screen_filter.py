"""`make run`'s screen (scripts/run-pipeline.sh): from `airflow dags test`'s log on stdin, each task as it starts, the
stages' progress lines, a failure's one-line cause (the task's ERROR line from tasks.pipeline.failure) and, once,
that an approval waits for a person — each printed as soon as its line arrives.

Python, not awk: Debian's and Ubuntu's awk is mawk, which reads a pipe in blocks, so the screen fell minutes behind
the run (a progress line reached it only when ~4 KB more log had followed it) unless called with mawk's own
`-W interactive`, an option other awks refuse.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys

TASK = re.compile(r".*task_id=(\S*)")
PROGRESS = re.compile(r".* progress: (.*?) +\[tasks\.progress\]")
ERROR = re.compile(r".*\[error +\] (.*?) +\[tasks\.pipeline\]")
APPROVAL = "  ? the approve task waits for a person: make ui, then Airflow → Browse → Required actions"


def screen_line(line: str, asked: bool) -> str | None:
    """What the screen shows for one log line (None: nothing); `asked`: the approval hint was shown already."""
    if "[DAG TEST] starting task_id=" in line:
        return "  … " + TASK.match(line).group(1)
    if m := PROGRESS.match(line):
        return "    progress: " + m.group(1)
    if m := ERROR.match(line):
        return "  ! " + m.group(1)
    if "Waiting for Human-in-the-loop input" in line and not asked:
        return APPROVAL
    return None


def record_ctrl_c(flag: str) -> None:
    """Ctrl-C reaches the whole foreground group: this filter keeps reading (Airflow's last lines follow) and records
    it in `flag` (run-pipeline.sh: $LLM_RUN_INTERRUPTED), which run-pipeline.sh reads when the pipe ends — its own
    bash trap alone missed one now and then on a loaded host. Started with SIGINT ignored (run-pipeline.sh's
    `trap ''`), so a Ctrl-C before this handler exists is ignored, never a KeyboardInterrupt."""

    def caught(signum, frame):
        with open(flag, "a", encoding="utf-8"):
            pass

    signal.signal(signal.SIGINT, caught)


def main() -> None:
    if flag := os.environ.get("LLM_RUN_INTERRUPTED"):
        record_ctrl_c(flag)
    # Line by line as the pipe delivers them (TextIOWrapper's readline returns what has arrived), never a block.
    stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    asked = False
    for line in stdin:
        shown = screen_line(line.rstrip("\n"), asked)
        if shown is not None:
            asked = asked or shown == APPROVAL
            print(shown, flush=True)


if __name__ == "__main__":
    main()
