#!/usr/bin/env bash
# `make run`: the whole llm_pipeline DAG in one process (`airflow dags test`), progress on screen, the full log in
# var/logs/make-run-<time>.log (one per invocation; or $LLM_RUN_LOG), then the one-screen summary of THIS run (its tasks write their
# run directory to $LLM_PIPELINE_RUN_DIR_FILE, so two `make run` at once each report their own). Exits non-zero unless every
# stage succeeded. CONF arrives in $LLM_PIPELINE_CONF (see the Makefile): it is data, never part of a command line.
set -uo pipefail
cd "$(dirname "$0")/.."
umask 022  # files 0644, directories 0755 whatever the caller's umask (secrets and credential DBs: 0600)
source scripts/airflow-env.sh
conf="${LLM_PIPELINE_CONF:-${1:-}}"
[ -n "$conf" ] || conf='{}'
var="${LLM_PIPELINE_VAR_DIR:-var}"
stamp=$(date -u +%Y%m%dT%H%M%S.%6N)-$$
log="${LLM_RUN_LOG:-$var/logs/make-run-$stamp.log}"
export LLM_PIPELINE_RUN_DIR_FILE="$var/logs/.make-run-$stamp.rundir"
if ! mkdir -p "$(dirname "$log")" 2>/dev/null || ! touch "$log" 2>/dev/null; then
  echo "error: cannot write the run log $log ($(touch "$log" 2>&1 | sed 's/.*: //')); fix the permissions of $var or set LLM_PIPELINE_VAR_DIR" >&2
  exit 2
fi
preset=$(LLM_PIPELINE_CONF="$conf" python - <<'PY'
import os, sys
from tasks.errors import StageError
from tasks.pipeline import check_conf
try:
    print(check_conf(os.environ["LLM_PIPELINE_CONF"]).preset)
except StageError as e:  # bad JSON, not an object, unknown Param, unknown preset, invalid value: one line
    sys.exit(f"error: CONF {os.environ['LLM_PIPELINE_CONF'][:200]}: {e}")
except OSError as e:
    sys.exit(f"error: CONF: {getattr(e, 'filename', '') or ''}: {e.strerror or e}")
PY
) || exit 2
echo "llm_pipeline on $preset (conf: $conf); full log: $log"
start=$(date +%s)
# One `airflow dags test` at a time per var dir: two at once race in Airflow's own metadata DB (both insert the DAG's
# rows). A second `make run` waits for the first, then runs and reports its own run.
exec 9>>"$var/logs/.make-run.lock"
if ! flock -n 9; then
  echo "  waiting for the other make run ($(cat "$var/logs/.make-run.holder" 2>/dev/null || echo '?')) to finish…"
  flock 9
fi
echo "pid $$, log $log" > "$var/logs/.make-run.holder"
# On screen: each task as it starts, the stages' progress lines, a failure's one-line cause, and once, that an
# approval waits for a person — as each line arrives (scripts/screen_filter.py; not awk: mawk reads a pipe in blocks).
# Ctrl-C reaches the whole foreground group: Airflow fails the running task and ends the run on its own. The log's
# tee and the screen filter ignore it, so both get Airflow's last lines (the filter's KeyboardInterrupt traceback and a
# log cut at the Ctrl-C were all a user saw), and this script says it was interrupted, then exits 130. The filter also
# records the Ctrl-C in $LLM_RUN_INTERRUPTED: this shell's own trap missed one now and then on a loaded host.
interrupted=
trap 'interrupted=1' INT
export LLM_RUN_INTERRUPTED="$var/logs/.make-run-$$.interrupted"  # the screen filter records a Ctrl-C there too
rm -f "$LLM_RUN_INTERRUPTED"
airflow dags test llm_pipeline --conf "$conf" 2>&1 | (trap '' INT && exec tee "$log") \
  | (trap '' INT && exec python -u scripts/screen_filter.py)
status=${PIPESTATUS[0]}
trap - INT
[ ! -e "$LLM_RUN_INTERRUPTED" ] || interrupted=1
rm -f "$LLM_RUN_INTERRUPTED"
run=$(cat "$LLM_PIPELINE_RUN_DIR_FILE" 2>/dev/null); rm -f "$LLM_PIPELINE_RUN_DIR_FILE"
echo
stopped="make run was interrupted (Ctrl-C): the tasks still to run did not run; the full log is $log; \`make run\` again starts a new run"
if [ -z "$run" ]; then
  [ -z "$interrupted" ] || { echo "error: $stopped" >&2; exit 130; }
  cause=$(grep -m1 -oE "(ParamValidationError|ConfigError|StageError|AirflowFailException): .*|\[error +\] .* \[tasks\.pipeline\]" "$log" \
    | sed -E 's/^\[error +\] //; s/ +\[tasks\.pipeline\]$//' | cut -c1-300)
  echo "error: no stage ran: ${cause:-see $log}" >&2; exit 1
fi
python -m tasks summary --run-dir "$run" --config "$preset" --check || status=1  # the run's preset's MLflow links
echo
echo "Took $(( $(date +%s) - start )) s. Run directory: $run  Log: $log"
python -c 'import sys; from tasks.config import load_config; from tasks.tracking import ui_hint; print(ui_hint(load_config(sys.argv[1])))' "$preset"
[ -z "$interrupted" ] || { echo "error: $stopped" >&2; exit 130; }
exit $status
