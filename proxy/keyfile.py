"""The admin key file, read again while the proxy runs: the admin key rotates without a restart.

The file (its format is ``contract/keyfile.py``'s, shared with every client that reads it): the
first non-empty line is the admin key (new episode keys and dashboard sessions are signed with it);
further lines are earlier keys, still accepted until they are removed; lines starting with ``#``
are comments. Each proxy process reads it again on SIGHUP and every
``auth.key_reload_s`` seconds, so every worker and every replica that mounts the same file (a
Kubernetes or Docker secret, a shared volume) follows a change without being signalled. A key that
leaves the file keeps working for ``auth.rotation_grace_s`` seconds in each process that had it
(``KeyRing.replace``): trainers and workflows switch within that window, and the episodes whose keys
it signed keep running. A file that cannot be read, holds no key or a key shorter than 16
characters is refused: the keys in use stay, and a warning says why (never what the file holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from contract.keyfile import key_file_keys
from proxy.auth import KeyRing
from proxy.settings import MIN_KEY_CHARS, AuthSettings

log = logging.getLogger("flywheel.auth")
Reload = Literal["rotated", "unchanged", "refused"]


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and the line, never a key."""


def read_keys(path: Path) -> list[str]:
    """The keys in ``path``, the current one first, each once."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read the admin key file {path}: {type(exc).__name__}") from None
    keys: list[str] = []
    for number, key in enumerate(key_file_keys(text), 1):
        if len(key) < MIN_KEY_CHARS:
            raise KeyFileError(f"the admin key file {path}: key {number} is under {MIN_KEY_CHARS} characters")
        if key not in keys:
            keys.append(key)
    if not keys:
        raise KeyFileError(f"the admin key file {path} holds no key")
    return keys


def initial_keys(auth: AuthSettings) -> list[str]:
    """The admin keys a new app starts with: the key file's if one is set, else ``auth.admin_key``."""
    if auth.admin_key_file is not None:
        return read_keys(Path(auth.admin_key_file))
    assert auth.admin_key is not None  # AuthSettings requires one of the two
    return [auth.admin_key.get_secret_value()]


class KeyFile:
    """Follows the key file into one process's ``KeyRing``."""

    def __init__(
        self,
        path: Path,
        ring: KeyRing,
        keys: list[str],
        *,
        grace_s: float,
        on_reload: Callable[[Reload], None] | None = None,
    ) -> None:
        """``keys``: what the ring was built from (the file as it was read at start)."""
        self.path = path
        self.ring = ring
        self.grace_s = grace_s
        self._keys = keys
        self._on_reload = on_reload
        self._last_error: str | None = None

    def _read(self) -> list[str] | KeyFileError:
        try:
            return read_keys(self.path)
        except KeyFileError as exc:
            return exc

    def reload(self) -> Reload:
        """Read the file now (SIGHUP); if its keys changed, hand them to the ring."""
        return self._apply(self._read())

    def _apply(self, read: list[str] | KeyFileError) -> Reload:
        if isinstance(read, KeyFileError):
            if str(read) != self._last_error:  # once per distinct problem, not every poll
                log.warning("admin key file refused; the keys in use stay: %s", read)
            self._last_error = str(read)
            return self._done("refused")
        self._last_error = None
        if read == self._keys:
            return self._done("unchanged")
        retired = self.ring.replace(read, grace_s=self.grace_s)
        self._keys = read
        log.warning(
            "admin key file changed: %d key(s) listed, %d retired (accepted for %.0f s more)",
            len(read),
            retired,
            self.grace_s,
        )
        return self._done("rotated")

    def _done(self, outcome: Reload) -> Reload:
        if self._on_reload is not None:
            self._on_reload(outcome)
        return outcome

    async def watch(self, interval_s: float) -> None:
        """Re-read the file every ``interval_s`` seconds, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(interval_s)
            self._apply(await asyncio.to_thread(self._read))  # a file on a network volume may be slow

    def on_sighup(self) -> Callable[[], None]:
        """Re-read the file on SIGHUP in this process; returns the function that removes the handler.
        Nothing is installed where the loop cannot take signals (not the main thread, Windows)."""
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
            return lambda: None

        def remove() -> None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGHUP)

        return remove
