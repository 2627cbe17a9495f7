#!/usr/bin/env bash
# make clean: remove the var dir `make run` uses — var/, or $LLM_PIPELINE_VAR_DIR where it is set. Only a directory
# inside this checkout that holds no file git tracks (and is not .git) is removed: a mistyped variable must not delete
# a home directory or the code (LLM_PIPELINE_VAR_DIR=tasks); anything else is kept, in one line saying how to clean.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd -P)"
var="${LLM_PIPELINE_VAR_DIR:-$repo/var}"
[ -e "$var" ] || exit 0
keep() {
  echo "make clean: LLM_PIPELINE_VAR_DIR=$var $1, so it is not removed; remove it yourself (rm -rf $var) or unset" \
    "the variable to clean $repo/var" >&2
  exit 1
}
[ -d "$var" ] || keep "is not a directory"
abs="$(cd "$var" && pwd -P)"
case "$abs/" in
  "$repo"/?*/) ;;
  *) keep "is outside this checkout" ;;
esac
rel="${abs#"$repo"/}"
case "/$rel/" in
  /.git/*) keep "is git's own directory" ;;
esac
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1 && [ -n "$(git -C "$repo" ls-files -- "$rel" | head -1)" ]; then
  keep "holds files git tracks (it is part of the code)"
fi
# What is running from it would lose its files underneath it (and `make stop` its pid files, leaving the servers
# orphaned on their ports): refused while `make ui`'s servers or a `make run` are running from this var dir.
# shellcheck source=scripts/pidfile.sh
source "$repo/scripts/pidfile.sh"  # a pid file counts only while its pid is still the process ui.sh started
for name in airflow mlflow; do
  if pid_live "$abs/$name.pid" || pid_group_left "$abs/$name.pid"; then
    echo "make clean: make ui's $name (pid $pid_of) is running from $var; run make stop first, then make clean" >&2
    exit 1
  fi
done
if [ -e "$abs/logs/.make-run.lock" ] && ! flock -n "$abs/logs/.make-run.lock" true 2>/dev/null; then
  echo "make clean: a make run is running from $var ($(cat "$abs/logs/.make-run.holder" 2>/dev/null || echo '?'));" \
    "wait for it (or stop it with Ctrl-C), then make clean" >&2
  exit 1
fi
rm -rf -- "$abs"
