#!/usr/bin/env bash
# make clean: remove the var dir `make run` uses — var/, or $LLM_PIPELINE_VAR_DIR where it is set. A var dir outside
# this checkout is not removed (a mistyped variable must not delete a home directory): one line says so.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
var="${LLM_PIPELINE_VAR_DIR:-$repo/var}"
[ -e "$var" ] || exit 0
abs="$(cd "$var" && pwd -P)"
case "$abs/" in
  "$(cd "$repo" && pwd -P)"/?*/) rm -rf -- "$abs" ;;
  *)
    echo "make clean: LLM_PIPELINE_VAR_DIR=$var is outside this checkout, so it is not removed; remove it yourself" \
      "(rm -rf $var) or unset the variable to clean $repo/var" >&2
    exit 1
    ;;
esac
