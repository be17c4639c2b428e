"""Under systemd: the unit (``unit``, what ``headrace systemd-unit`` prints), and sd_notify without libsystemd.

The unit is written here, once: ``configs/headrace.service`` is its default rendering (a test keeps
them equal) and ``systemd-analyze verify`` checks both renderings where it is installed.

sd_notify is a datagram to $NOTIFY_SOCKET when run as Type=notify, one per state change; the PyPI
clients are either unmaintained (sdnotify, last release 2017) or bind libsystemd and need a C
toolchain (systemd-python, cysystemd), so these few lines stay here.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import Mapping

log = logging.getLogger(__name__)

DEFAULT_EXEC = "headrace"
DEFAULT_CONFIG = "/etc/headrace/headrace.toml"

_DYNAMIC_USER = """\
# A throwaway system user, made when the service starts; state and cache dirs are created and
# owned for it (`headrace systemd-unit --user NAME` names a dedicated user of yours instead).
DynamicUser=yes"""

_NAMED_USER = """\
# A dedicated system user (create it first: useradd --system --no-create-home {user}); state and
# cache dirs are created and owned for it.
User={user}
Group={user}"""

_UNIT = """\
# systemd unit for headrace (written by `headrace systemd-unit`). Install:
#   headrace systemd-unit > /etc/systemd/system/headrace.service
#   mkdir -p /etc/headrace && cp configs/default.toml /etc/headrace/headrace.toml
#   systemctl daemon-reload && systemctl enable --now headrace
# Put secrets in a drop-in (systemctl edit headrace), not here:
#   [Service]
#   Environment=HEADRACE_API_KEY=...

[Unit]
Description=headrace compound-AI serving daemon
Documentation=file://{config}
Wants=network-online.target
After=network-online.target

[Service]
# The daemon calls sd_notify(READY=1) once every engine has loaded (STATUS= says which
# engine loads meanwhile: `systemctl status headrace`), STOPPING=1 when it starts to drain,
# and WATCHDOG=1 every WatchdogSec/2 while it is alive: its task groups and every engine
# loop running (what /health reports), and each engine's worker thread answering a
# heartbeat within WatchdogSec/2. Pings stop when a loop dies or an engine is wedged (a
# forward pass stuck for about WatchdogSec), and systemd then kills and restarts it
# (Restart=on-failure covers watchdog timeouts). Raise WatchdogSec if one forward pass of
# your model can legitimately take longer than half of it.
Type=notify
NotifyAccess=main
WatchdogSec=30
# A bare name is looked up in /usr/local/bin, /usr/bin...; for a venv give its full
# path (outside /home: ProtectHome hides it), e.g. /opt/headrace/bin/headrace.
ExecStart={exec_start} serve --config {config}

{user_lines}
StateDirectory=headrace
CacheDirectory=headrace
# Only the service's user enters them: the state dir holds users' conversations, KV and collections.
StateDirectoryMode=0700
CacheDirectoryMode=0700
# %S and %C are /var/lib and /var/cache; these map onto [data] dir and cache_dir.
Environment=HEADRACE_DATA_DIR=%S/headrace
Environment=HEADRACE_DATA_CACHE_DIR=%C/headrace
# Models ship in installed packages or local paths; never reach for the Hub.
Environment=HF_HUB_OFFLINE=1

# The first start may convert model weights into the cache, which takes a while.
TimeoutStartSec=300
# SIGTERM starts the drain: /ready turns 503, new requests get 503, in-flight requests and
# runs get server.drain_seconds (30 by default) to finish, then the process exits 0.
# TimeoutStopSec must exceed drain_seconds plus a few seconds of shutdown, or systemd's
# SIGKILL cuts the drain short; raise both together.
KillSignal=SIGTERM
TimeoutStopSec=45
Restart=on-failure
RestartSec=5

# Hardening: the daemon only needs its own state and cache directories, which
# StateDirectory= and CacheDirectory= leave writable under ProtectSystem=strict.
# UMask=0077: every file it writes is 0600 (the daemon sets this umask itself too).
UMask=0077
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes

[Install]
WantedBy=multi-user.target
"""


def unit(user: str | None = None, exec_start: str = DEFAULT_EXEC, config: str = DEFAULT_CONFIG) -> str:
    """The service unit: run by a dynamic user, or by ``user`` (a dedicated system user that exists)."""
    if user is not None and not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", user):
        raise ValueError(f"{user!r} is not a system user name (lower-case letters, digits, '_' and '-')")
    for what, value in (("the headrace executable", exec_start), ("the config path", config)):
        if not value or any(c.isspace() or c in "%$\\\"'" for c in value):
            raise ValueError(f"{what} {value!r} must be one word without quotes, '%' or '$' (a systemd specifier)")
    user_lines = _DYNAMIC_USER if user is None else _NAMED_USER.format(user=user)
    return _UNIT.format(exec_start=exec_start, config=config, user_lines=user_lines)


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
