#!/usr/bin/env bash
# Build the SQLite database the task asks about from its SQL dump (text in the repository).
set -euo pipefail
python3 -c "import sqlite3; c = sqlite3.connect('shop.db'); c.executescript(open('shop.sql').read()); c.commit()"
