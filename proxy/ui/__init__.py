"""The dashboard under ``/ui``: server-rendered pages (Jinja2) over the store, behind the admin key."""
