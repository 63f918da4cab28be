"""The store: ORM models, engine and migrations, and the repository (the only code that commits)."""
