"""Free ports for tests that start a process group (tests/test_hosts.py,
tests/test_hardening_peers.py)."""

from __future__ import annotations

import socket


def group_port() -> int:
    """A free port whose next port is free too (the coordinator's, then the leader's channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")
