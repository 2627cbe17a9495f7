"""Free loopback ports for the servers tests start (Airflow, MLflow, PostgreSQL, Redis, torchrun's rendezvous).

`bind(("127.0.0.1", 0))` returns a port from the kernel's ephemeral range (net.ipv4.ip_local_port_range), the same
range every outgoing connection takes its local port from. A server started a minute later on that port (the
api-server starts after `airflow db migrate`) can find it taken by one of the many client connections the suite
makes meanwhile: CI lost six cluster tests to "[Errno 98] … address already in use" that way. Ports below that
range are never handed out implicitly, so only another explicit server can collide, and a random pick among ~10,000
makes that unlikely; each candidate is still checked by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_pick = random.SystemRandom()  # not the tests' seeded `random`: xdist workers must not draw the same ports
_given: set[int] = set()  # handed out by this process: `{k: free_port() for k in …}` never repeats one (its servers
# bind them later, so the bind check alone would pass the same port twice)


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now and this process has not handed out, outside the kernel's
    ephemeral range."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(200):
        port = _pick.randrange(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {low}–{high - 1} after 200 tries")
