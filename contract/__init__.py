"""What crosses a process boundary, declared once: the proxy on one side, the trainer, the workflows,
the launcher and users' scripts on the other.

The control API's entities, one model each for the proxy that answers with them and the clients
that read them (``entities``), its request models (``schemas``), its closed choices
(``vocabulary``), the token-prefix rule a delta follows (``tokens``), the admin key file's format
(``keyfile``) and the one client of the control API (``client``: each call declared once in
``endpoints``, one retry rule in ``retry``). The processes share these declarations, never code
that runs on the other side: this package depends on pydantic, httpx and the standard library
alone, so it imports in the engine venv (Python 3.11) and the agents venv (3.12) alike, and it must
not import ``proxy``, ``trainer``, ``workflows`` or ``deploy`` (``tests/test_imports.py``).
"""
