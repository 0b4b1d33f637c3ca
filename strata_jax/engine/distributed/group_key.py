"""The group's key (group_channel.py's handshake proves it): --group-key-file FILE's first line (16
characters or more, the same on every host), else, for a group whose coordinator is a loopback
address, <cache folder>/group-key, made once with mode 0600 (one user's processes on one machine
share it; other users cannot read it). hosts.py checks it at start; group_channel.py signs and
checks the handshake with it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ... import envs
from ...config import ConfigError, EngineConfig

KEY_MIN_CHARS = 16
AUTO_KEY = "group-key"          # in the cache folder: a loopback group's key when none is given


def group_key(cfg: EngineConfig) -> bytes:
    """The group's key: --group-key-file's first line, else (a loopback coordinator) the cache
    folder's."""
    if cfg.group_key_file is None:
        return _auto_key()
    name = f"group_key_file = {cfg.group_key_file!r}"
    try:
        lines = (
            Path(cfg.group_key_file).expanduser().read_text(encoding="utf-8").strip().splitlines()
        )
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{name}: cannot read it ({e})") from None
    key = lines[0].strip() if lines else ""
    if len(key) < KEY_MIN_CHARS:
        raise ConfigError(f"{name}: its first line must be a key of {KEY_MIN_CHARS} characters or "
                          "more, the same on every host (e.g. made by: openssl rand -hex 32 > "
                          "FILE)")
    return key.encode()


def _auto_key() -> bytes:
    """<cache>/group-key, made once (mode 0600, never following a link). The processes of one user
    on one machine race to make it: each writes its own temporary file and links it into place; the
    loser reads the winner's. A file another user owns, or others may read, is refused: its key
    would not be a secret."""
    folder = envs.cache_dir()
    path = folder / AUTO_KEY
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = folder / f".{AUTO_KEY}-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (secrets.token_hex(32) + "\n").encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"group_key_file = None: the loopback group's key {path} cannot be read "
                          f"({e}); give --group-key-file FILE") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"group_key_file = None: {path} is owned by another user or others "
                              "may read it; remove it (it is made again) or give --group-key-file "
                              "FILE")
        key = f.read().strip()
    if len(key) < KEY_MIN_CHARS:
        raise ConfigError(f"group_key_file = None: {path} holds no key; remove it (it is made "
                          "again)")
    return key
