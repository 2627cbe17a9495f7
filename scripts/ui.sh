#!/usr/bin/env bash
# `make ui`: Airflow (standalone: api-server, scheduler, dag-processor, triggerer) and an MLflow server, both on
# 127.0.0.1 and both asking for a password. PIDs, logs and generated secrets go to $LLM_PIPELINE_VAR_DIR (default var/);
# `make stop` (scripts/stop.sh) stops both.
#
# Environment: AIRFLOW_PORT (8080), MLFLOW_PORT (5000), LLM_PIPELINE_VAR_DIR (var/), MLFLOW_TRACKING_URI (SQLite in var/),
# UI_WAIT_S (180: how long to wait for both to answer).
set -euo pipefail
# The numbers are checked as text before anything starts: bash evaluates a value inside $(( )) as code (an array index
# runs a command substitution), and a port that is not a number would be "not busy" and reach the servers.
number() {  # variable value max
  if ! [[ "$2" =~ ^[0-9]{1,6}$ ]] || (( 10#$2 > $3 )) || { [ "$1" != UI_WAIT_S ] && (( 10#$2 < 1 )); }; then
    local range="0-$3"; [ "$1" = UI_WAIT_S ] || range="1-$3"
    printf 'ui: %s=%q is not a whole number in %s: unset it or set e.g. %s=%s\n' "$1" "$2" "$range" "$1" "$4" >&2
    exit 2
  fi
}
number AIRFLOW_PORT "${AIRFLOW_PORT:-8080}" 65535 8080
number MLFLOW_PORT "${MLFLOW_PORT:-5000}" 65535 5000
number UI_WAIT_S "${UI_WAIT_S:-180}" 999999 180
number STOP_WAIT_S "${STOP_WAIT_S:-20}" 999999 20  # scripts/stop.sh's, run if a server fails to start
umask 022  # files 0644, directories 0755 whatever the caller's umask (secrets below: 077)
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
given="${LLM_PIPELINE_VAR_DIR:-$repo/var}"
# A var dir that takes no write was mkdir's (or Permission denied) lines with no fix: one line, before anything starts.
if ! probe_err=$( { mkdir -p "$given/logs" && : > "$given/logs/.write-probe" && rm -f "$given/logs/.write-probe"; } 2>&1 ); then
  echo "ui: $given is not writable ($(printf '%s' "$probe_err" | head -n1 | sed 's/.*: //')): fix its permissions, or set LLM_PIPELINE_VAR_DIR to a writable directory" >&2
  exit 2
fi
var="$(cd "$given" && pwd)"
host=127.0.0.1
af_port=$((10#${AIRFLOW_PORT:-8080}))
ml_port=$((10#${MLFLOW_PORT:-5000}))
ui_wait_s=$((10#${UI_WAIT_S:-180}))

# State lives in $var (a test points it at a temp dir); airflow-env.sh keeps values that are already set.
export LLM_PIPELINE_VAR_DIR="$var"   # the stages' runs, data and MLflow artifacts follow it (tasks.config.var_dir)
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$var/airflow.db}"
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$var/mlflow.db}"
# shellcheck source=scripts/airflow-env.sh
source "$repo/scripts/airflow-env.sh"
export AIRFLOW__LOGGING__BASE_LOG_FOLDER="$var/logs"
export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE="$var/simple_auth_manager_passwords.json.generated"
export AIRFLOW__API__HOST="$host" AIRFLOW__API__PORT="$af_port"
export AIRFLOW__API__BASE_URL="http://$host:$af_port"
export MLFLOW_UI_URL="${MLFLOW_UI_URL:-http://$host:$ml_port}"   # read by plugins/mlflow_link.py
mkdir -p "$var/logs"

# shellcheck source=scripts/pidfile.sh
source "$repo/scripts/pidfile.sh"  # pid_live: the pid file names the very process this script started, still running
running() { pid_live "$1"; }
port_busy() { python -c 'import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(("127.0.0.1", int(sys.argv[1]))) != 0)' "$1"; }
for name in airflow mlflow; do
  if running "$var/$name.pid"; then
    echo "ui: $name already running (pid $pid_of); run 'make stop' first" >&2
    exit 1
  elif pid_group_left "$var/$name.pid"; then  # its first process exited, the rest of its group did not
    echo "ui: $name's processes are still running (process group $pid_of); run 'make stop' first" >&2
    exit 1
  elif [ -e "$var/$name.pid" ]; then  # its process exited, or the pid is another program's now (after a reboot)
    echo "ui: $var/$name.pid is stale (pid ${pid_of:-?} is no longer the $name make ui started: it exited, or the" \
      "host rebooted): replacing it" >&2
    rm -f "$var/$name.pid"
  fi
done
for name in AIRFLOW_PORT MLFLOW_PORT; do  # the variable that names the busy port, so the fix is clear
  port=$af_port; [ "$name" = AIRFLOW_PORT ] || port=$ml_port
  if port_busy "$port"; then
    echo "ui: $name=$port: $host:$port is already in use by another program (or a make ui of another LLM_PIPELINE_VAR_DIR): stop it, or set $name to a free port" >&2
    exit 1
  fi
done

# Secrets are generated once per state dir, kept private (0600, and so are the logs), never committed (var/ is
# git-ignored), never printed. Airflow's SimpleAuthManager would create its password file 0644 and print the password
# into airflow-standalone.log: we write the file first (0600), so it finds the user's password and prints nothing.
umask 077
af_pw_file="$AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
[ -s "$af_pw_file" ] || python -c 'import json, secrets; print(json.dumps({"admin": secrets.token_urlsafe(18)}))' > "$af_pw_file"
secret() { [ -s "$1" ] || python -c 'import secrets; print(secrets.token_urlsafe(24))' > "$1"; cat "$1"; }
# Every Airflow component must sign/verify task tokens with the same key; an empty one is random per process.
export AIRFLOW__API_AUTH__JWT_SECRET="${AIRFLOW__API_AUTH__JWT_SECRET:-$(secret "$var/airflow_jwt_secret")}"
export AIRFLOW__CORE__FERNET_KEY="${AIRFLOW__CORE__FERNET_KEY:-$(
  [ -s "$var/airflow_fernet_key" ] || python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())' > "$var/airflow_fernet_key"
  cat "$var/airflow_fernet_key")}"
ml_password_file="$var/mlflow_admin_password"
ml_pw_where="${MLFLOW_AUTH_ADMIN_PASSWORD:+\$MLFLOW_AUTH_ADMIN_PASSWORD (your environment)}"
ml_pw_where="${ml_pw_where:-$ml_password_file}"
export MLFLOW_AUTH_ADMIN_PASSWORD="${MLFLOW_AUTH_ADMIN_PASSWORD:-$(secret "$ml_password_file")}"
export MLFLOW_FLASK_SERVER_SECRET_KEY="${MLFLOW_FLASK_SERVER_SECRET_KEY:-$(secret "$var/mlflow_flask_secret")}"  # CSRF
# auth_cache_ttl_seconds: MLflow checks the basic-auth password on every request (werkzeug scrypt, ~0.1 s of CPU
# each), and one page of its UI makes dozens of API calls: seconds of CPU per page. With the cache (MLflow's own, off
# by default) a password that checked out is trusted again for 60 s by the server process (keyed by an HMAC of it
# with a per-process key, never stored): a changed or removed password keeps working for up to 60 s more.
cat > "$var/mlflow_basic_auth.ini" <<EOF
[mlflow]
default_permission = READ
database_uri = sqlite:///$var/mlflow_auth.db
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 60
EOF
export MLFLOW_AUTH_CONFIG_PATH="$var/mlflow_basic_auth.ini"
private_sqlite "sqlite:///$var/mlflow_auth.db"  # the admin's password hash (scripts/airflow-env.sh)
for f in "$af_pw_file" "$var"/airflow_jwt_secret "$var"/airflow_fernet_key "$ml_password_file" \
  "$var"/mlflow_flask_secret "$var/mlflow_basic_auth.ini"; do  # also files an older version created 0644
  [ ! -e "$f" ] || chmod 600 "$f"  # a secret given in the environment has no file
done
touch "$var/logs/mlflow-server.log" "$var/logs/airflow-standalone.log"
chmod 600 "$var/logs/mlflow-server.log" "$var/logs/airflow-standalone.log"
umask 022

mkdir -p "$var/mlartifacts"
# MLflow 3's server also starts a job runner and seven Huey consumers for its GenAI jobs (LLM judges, prompt
# optimisation, trace rollups; mlflow/server/__init__.py, MLFLOW_SERVER_ENABLE_JOB_EXECUTION, default true): 8 more
# Python processes, ~2 GB of memory and ~30 CPU s to start, none of it used by this pipeline. Set it to true to have them.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
setsid mlflow server --app-name basic-auth --host "$host" --port "$ml_port" --workers 1 \
  --backend-store-uri "$MLFLOW_TRACKING_URI" --default-artifact-root "$var/mlartifacts" \
  > "$var/logs/mlflow-server.log" 2>&1 < /dev/null &
pid_write "$var/mlflow.pid" $!

# Defence in depth: a generated password line (a user added to simple_auth_manager_users later) is redacted.
setsid python "$repo/scripts/sigint-exec.py" airflow standalone \
  > >(sed -u -E "s/(Password for user '[^']*': ).*/\1<redacted: see $(basename "$af_pw_file")>/" \
       >> "$var/logs/airflow-standalone.log" 2>&1) 2>&1 < /dev/null &
pid_write "$var/airflow.pid" $!

fail() { bash "$repo/scripts/stop.sh" >&2; exit 1; }  # leave nothing half-started behind
wait_for() {  # name url pidfile log
  local deadline=$((SECONDS + ui_wait_s))
  until python - "$2" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=3).read()
EOF
  do
    if ! running "$3"; then echo "ui: $1 exited; see $4" >&2; tail -n 20 "$4" >&2; fail; fi
    if [ $SECONDS -ge $deadline ]; then echo "ui: $1 did not answer $2 in time; see $4" >&2; fail; fi
    sleep 2
  done
}
wait_for mlflow "http://$host:$ml_port/health" "$var/mlflow.pid" "$var/logs/mlflow-server.log"
wait_for airflow "http://$host:$af_port/api/v2/monitor/health" "$var/airflow.pid" "$var/logs/airflow-standalone.log"

cat <<EOF
Airflow  http://$host:$af_port   user admin, password in $AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE
MLflow   http://$host:$ml_port   user admin, password in $ml_pw_where
Logs     $var/logs/airflow-standalone.log, $var/logs/mlflow-server.log
Stop     make stop
EOF
