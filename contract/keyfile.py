"""The admin key file's format, the one rule its readers share.

The proxy follows the file into its key ring (``proxy/keyfile.py``: reads again on SIGHUP and on a
timer, refuses short keys); the trainer, the workflows and the launcher read it to find the key
they send. Both sides must agree on which line is the current key, so the format is declared here.
"""

from __future__ import annotations


def key_file_keys(text: str) -> list[str]:
    """The keys in an admin key file's text: its lines that are neither blank nor ``#`` comments.
    The first is the admin key a client sends; later ones are earlier keys the proxy still accepts
    while a rotation's clients switch (``proxy/keyfile.py``)."""
    return [key for line in text.splitlines() if (key := line.strip()) and not key.startswith("#")]
