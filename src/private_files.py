"""Files only the daemon's user may read: directories 0700, files 0600, whatever the umask.

The data dir holds other people's words: the KV tiers' files (a recoverable encoding of every
evicted prompt prefix), the Responses store's whole conversations, the collections' chunks.
``private_data_dir`` is called once where the daemon is composed: it sets the process umask to
0077, so every writer in the process, the third-party ones too (LanceDB's Rust writer, SQLite's
WAL and shared-memory files), creates private files; and it makes the data dir itself 0700. The
few files our own code creates also pass their mode explicitly (``private_dir``, ``open_private``),
so they stay private in a process whose umask someone else set back.

Shared by every layer (the engines write the KV tiers and LanceDB), so it imports nothing of headrace.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

UMASK = 0o077
DIR_MODE, FILE_MODE = 0o700, 0o600


def private_dir(path: Path) -> Path:
    """``path`` as a directory, each component this creates 0700 (``Path.mkdir(parents=True)`` gives
    the parents the umask's default, not ``mode``)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=DIR_MODE)
        except FileExistsError:  # another daemon on the same data dir made it meanwhile
            pass
    return path


def open_private(path: Path, mode: str = "wb") -> IO:
    """``open(path, mode)`` for writing, the file 0600 even when it already existed (a partial
    file a crash left under an older, looser umask)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def private_data_dir(data_dir: Path) -> Path:
    """Make the process's files private from now on (umask 0077) and the data dir 0700.

    A data dir that exists with looser modes (made by an older headrace, or by hand) is tightened,
    not refused: 0700 on the directory alone already shuts every other user out of everything
    under it (they cannot traverse it), and what the daemon writes from now on is 0600. Files
    already there keep their modes; a warning says so, with the command that tightens them.
    A data dir owned by another user is left alone, with a warning: changing it is not ours to do.
    """
    os.umask(UMASK)
    private_dir(data_dir)
    st = data_dir.stat()
    loose = stat.S_IMODE(st.st_mode) & UMASK
    if not loose:
        return data_dir
    if st.st_uid != os.geteuid():
        log.warning("data dir %s is mode %04o and owned by uid %d, not this process's %d: left as it is; "
                    "make it 0700 (other users can read what the daemon keeps there)",
                    data_dir, stat.S_IMODE(st.st_mode), st.st_uid, os.geteuid())
        return data_dir
    os.chmod(data_dir, stat.S_IMODE(st.st_mode) & ~UMASK)
    log.warning("data dir %s was mode %04o: tightened to %04o; files already under it keep their modes "
                "(unreachable to other users now); `chmod -R go= %s` tightens them too",
                data_dir, stat.S_IMODE(st.st_mode), stat.S_IMODE(st.st_mode) & ~UMASK, data_dir)
    return data_dir

