"""sd_notify without libsystemd: a datagram to $NOTIFY_SOCKET when run as Type=notify.

The protocol is one datagram per state change; the PyPI clients are either unmaintained
(sdnotify, last release 2017) or bind libsystemd and need a C toolchain (systemd-python,
cysystemd), so these few lines stay here.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``...); False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:  # a vanished socket must not take the daemon down
        log.warning("sd_notify(%s) to %s failed: %s", state, address, exc)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

    None when systemd watches nothing, or watches another process ($WATCHDOG_PID).
    """
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2 / 1e6 if value > 0 else None
