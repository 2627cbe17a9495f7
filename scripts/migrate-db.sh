#!/usr/bin/env bash
# `make db` (and so `make run`): check that the state directory (var/, or $LLM_PIPELINE_VAR_DIR) takes a
# write, then migrate Airflow's metadata DB. A read-only or full var/ is one line naming the directory and the cause,
# before Airflow writes anything; the migration's own log is shown only when this invocation wrote it.
set -uo pipefail
cd "$(dirname "$0")/.."
umask 022
var="${LLM_PIPELINE_VAR_DIR:-var}"
# A relative one was Airflow's traceback ("Cannot use relative path: sqlite:///…") and a stray directory in the
# checkout; the stages refuse it too (data_prep.config.var_dir): refused here first, in their words.
if [ -n "${LLM_PIPELINE_VAR_DIR:-}" ] && [ "${LLM_PIPELINE_VAR_DIR#/}" = "$LLM_PIPELINE_VAR_DIR" ]; then
  echo "error: LLM_PIPELINE_VAR_DIR=$LLM_PIPELINE_VAR_DIR is a relative path (each process would read it from its own working directory); give an absolute one, e.g. LLM_PIPELINE_VAR_DIR=\$PWD/$LLM_PIPELINE_VAR_DIR" >&2
  exit 2
fi
probe_err=$( { mkdir -p "$var/logs" && head -c 65536 /dev/zero > "$var/logs/.write-probe" && rm -f "$var/logs/.write-probe"; } 2>&1 )
if [ $? -ne 0 ]; then
  rm -f "$var/logs/.write-probe" 2>/dev/null
  echo "error: $var is not writable ($(printf '%s' "$probe_err" | head -n1 | sed 's/.*: //')): free space or fix its permissions, or set LLM_PIPELINE_VAR_DIR to a writable directory" >&2
  exit 2
fi
source scripts/airflow-env.sh
log=$(mktemp "$var/logs/.db-migrate.XXXXXX") || { echo "error: cannot write a log in $var/logs" >&2; exit 2; }
if ! airflow db migrate > "$log" 2>&1; then
  cat "$log" >&2
  mv -f "$log" "$var/logs/db-migrate.log"
  echo "error: airflow db migrate failed (log above, kept in $var/logs/db-migrate.log)" >&2
  exit 1
fi
mv -f "$log" "$var/logs/db-migrate.log"
