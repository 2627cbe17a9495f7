#!/usr/bin/env bash
# `make stop`: stop what `make ui` started. Airflow standalone gets SIGINT (its own shutdown stops its four
# components; SIGTERM to it alone would orphan them), MLflow gets SIGTERM. ui.sh started each in its own session
# (setsid), so the PID is also the process-group id. Airflow task processes start their own sessions, so the
# descendants are listed before the signal: whatever of the group or that list is left after STOP_WAIT_S (20)
# seconds gets SIGTERM, then SIGKILL. Zombies don't count as alive (PID 1 in a container may never reap them). A pid
# file whose pid is no longer the process ui.sh started (scripts/pidfile.sh) is removed, and nothing is signalled.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
var="${LLM_PIPELINE_VAR_DIR:-$repo/var}"
# Checked as text before any arithmetic: bash evaluates a variable's value inside $(( )) as code (an array index
# runs a command substitution), so nothing from the environment reaches one unchecked.
wait_s="${STOP_WAIT_S:-20}"
if ! [[ "$wait_s" =~ ^[0-9]{1,6}$ ]]; then
  printf 'stop: STOP_WAIT_S=%q is not a number of seconds (0-999999): unset it or set e.g. STOP_WAIT_S=20\n' "$wait_s" >&2
  exit 2
fi
wait_s=$((10#$wait_s))  # 08 is eight, not an octal error

# shellcheck source=scripts/pidfile.sh
source "$repo/scripts/pidfile.sh"  # pid_live / pid_group_left: the pid file's process is still the one recorded
group_alive() { ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {found = 1} END {exit !found}'; }

descendants() {  # every process below $1, whatever its session
  ps -eo pid=,ppid= | awk -v root="$1" '{kids[$2] = kids[$2] " " $1}
    END {todo[root]; while (length(todo)) for (p in todo) {delete todo[p]; n = split(kids[p], k, " ");
         for (i = 1; i <= n; i++) {print k[i]; todo[k[i]]}}}'
}

live() { for p in "$@"; do ps -o stat= -p "$p" 2>/dev/null | grep -qv '^Z' && echo "$p"; done; }

wait_gone() {  # pgid seconds pids...
  local pgid="$1" deadline=$((SECONDS + $2)); shift 2
  while { group_alive "$pgid" || [ -n "$(live "$@")" ]; } && [ $SECONDS -lt "$deadline" ]; do sleep 1; done
  ! group_alive "$pgid" && [ -z "$(live "$@")" ]
}

stop() {  # name signal
  local pidfile="$var/$1.pid" pid
  [ -f "$pidfile" ] || { echo "stop: $1 not running (no $pidfile)"; return 0; }
  # Only the process ui.sh started (or, once it exited, its group): a pid alone may be another program's now.
  if ! pid_live "$pidfile" && ! pid_group_left "$pidfile"; then
    echo "stop: $1 not running (stale pid ${pid_of:-?}: not the $1 make ui started; nothing signalled)"
    rm -f "$pidfile"
    return 0
  fi
  pid=$pid_of
  local kids; kids=$(descendants "$pid")
  kill -s "$2" "$pid" 2>/dev/null
  # shellcheck disable=SC2086
  if ! wait_gone "$pid" "$wait_s" $kids; then
    echo "stop: $1 still running $wait_s s after SIG$2; sending SIGTERM to what is left" >&2
    kill -s TERM -- "-$pid" $(live $kids) 2>/dev/null
    wait_gone "$pid" 10 $kids || kill -s KILL -- "-$pid" $(live $kids) 2>/dev/null
  fi
  rm -f "$pidfile"
  echo "stop: $1 stopped"
}
stop airflow INT
stop mlflow TERM
