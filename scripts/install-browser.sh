#!/usr/bin/env bash
# Install Debian's Chromium for the browser test (tests/test_browser.py drives it with Playwright).
# Playwright's own browser download can't work here (no network but the package registries), so the test
# launches /usr/bin/chromium. Idempotent: does nothing when chromium is already installed.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  echo "chromium already installed: $(chromium --version 2>/dev/null)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-browser.sh: needs root for apt-get (run: sudo $0)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium
chromium --version
