#!/usr/bin/env bash
# Install Debian's PostgreSQL and Redis for the scale-out tests (tests/test_celery_cluster.py starts them itself:
# unprivileged data directories under a temporary path, loopback ports; nothing here starts a service).
# Idempotent: does nothing when both servers are installed.
set -euo pipefail
have_pg() { compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; }
if have_pg && command -v redis-server >/dev/null 2>&1; then
  echo "postgresql and redis-server already installed: $(redis-server --version | cut -d' ' -f1-3)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-services.sh: needs root for apt-get (run: sudo $0)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends postgresql redis-server
have_pg && redis-server --version
