"""``python -m proxy serve|migrate|export``: run the proxy, upgrade the store's schema, or export episodes."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast, get_args

import typer

from proxy.settings import load_settings

if TYPE_CHECKING:
    from contract.vocabulary import EpisodeStatus
    from proxy.export import Filters as ExportFilters
    from proxy.export import Format as ExportFormat

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", exists=True, dir_okay=False, help="YAML config (see configs/); env FLYWHEEL_* overrides it"
    ),
]


def ensure_admin_key(path: Path) -> None:
    """Use FLYWHEEL_ADMIN_KEY if set (a fixed key); else read (or create, mode 0600) ``path`` and
    point the app at it (FLYWHEEL_ADMIN_KEY_FILE), which re-reads it while serving: the key
    rotates without a restart (``proxy/keyfile.py``). FLYWHEEL_ADMIN_KEY is set to its current key
    for this process's own readers; the file wins in the app."""
    if os.environ.get("FLYWHEEL_ADMIN_KEY"):
        return
    if not path.exists() and _create_key(path):
        typer.echo(f"created an admin key in {path} (clients read it from there or FLYWHEEL_ADMIN_KEY)", err=True)
    os.environ["FLYWHEEL_ADMIN_KEY"] = _read_key(path)
    os.environ["FLYWHEEL_ADMIN_KEY_FILE"] = str(path.resolve())


def _create_key(path: Path) -> bool:
    """Write a new key to ``path`` unless one is there; True if this process created it.

    The key is complete and mode 0600 before it has its name: written to a temporary file that
    ``mkstemp`` creates 0600, fsynced, then hard-linked to ``path``, which fails if ``path`` exists.
    Of several proxies starting at once, one creates the key and the others read that one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True


def _read_key(path: Path) -> str:
    """The file's current key (its first line), or a clear refusal (never the file's content)."""
    from proxy.keyfile import KeyFileError, read_keys

    try:
        return read_keys(path)[0]
    except KeyFileError as exc:
        raise typer.BadParameter(f"{exc}: delete it (a new key is created) or set FLYWHEEL_ADMIN_KEY") from None


@cli.command()
def serve(
    config: ConfigOpt = None,
    workers: Annotated[int, typer.Option(help="processes; SQLite and PostgreSQL both take several")] = 1,
    migrate: Annotated[bool, typer.Option(help="upgrade the schema before serving")] = True,
    admin_key_file: Annotated[
        Path, typer.Option(help="used unless FLYWHEEL_ADMIN_KEY, FLYWHEEL_ADMIN_KEY_FILE or auth.admin_key_file is set")
    ] = Path("data/admin.key"),
) -> None:
    """Serve the proxy (uvicorn, uvloop, httptools)."""
    import uvicorn

    from proxy.logs import configure
    from proxy.store.db import migrate as run_migrations

    ensure_admin_key(Path(os.environ.get("FLYWHEEL_ADMIN_KEY_FILE") or _configured_key_file(config) or admin_key_file))
    settings = load_settings(config)
    configure(settings.log_level, settings.log_format)
    if migrate:
        run_migrations(settings.store.url)
    if config is not None:
        os.environ["FLYWHEEL_CONFIG"] = str(config.resolve())
    uvicorn.run(
        "proxy.app:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        access_log=False,
        backlog=8192,
        log_config=None,
        timeout_graceful_shutdown=60,
        timeout_keep_alive=30,
    )


def _yaml_section(config: Path | None, name: str) -> dict[str, object]:
    """One section of the proxy's YAML, read without validating the rest (the key may be missing yet)."""
    import yaml

    data = yaml.safe_load(config.read_text()) if config else None
    root = data.get("proxy", data) if isinstance(data, dict) else {}
    section = root.get(name) if isinstance(root, dict) else None
    return section if isinstance(section, dict) else {}


def _configured_key_file(config: Path | None) -> str | None:
    """``auth.admin_key_file`` from the YAML, if it names one."""
    value = _yaml_section(config, "auth").get("admin_key_file")
    return str(value) if value else None


def _store_url(config: Path | None) -> str:
    """The store URL alone (migrating needs no admin key or upstreams): env, then YAML, then default."""
    from_env = os.environ.get("FLYWHEEL_STORE__URL") or os.environ.get("FLYWHEEL_STORE_URL")
    if from_env:
        return from_env
    from proxy.settings import StoreSettings

    return str(_yaml_section(config, "store").get("url") or StoreSettings().url)


@cli.command()
def migrate(config: ConfigOpt = None, revision: Annotated[str, typer.Option(help="target revision")] = "head") -> None:
    """Create or upgrade the store's schema (Alembic); safe to run again."""
    from proxy.store.db import migrate as run_migrations

    run_migrations(_store_url(config), revision)
    typer.echo(f"schema at {revision}")


@cli.command()
def export(
    out: Annotated[Path, typer.Option("--out", "-o", dir_okay=False, help="the file to write (replaced whole)")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="jsonl or parquet")] = "jsonl",
    status: Annotated[str | None, typer.Option(help="episode status: open, rewarded or abandoned")] = None,
    task: Annotated[str | None, typer.Option(help="task ids containing this")] = None,
    since: Annotated[str | None, typer.Option(help="created at or after: epoch seconds or ISO 8601 (UTC)")] = None,
    page: Annotated[int, typer.Option(min=1, max=10_000, help="episodes per read (and Parquet row group)")] = 100,
    config: ConfigOpt = None,
) -> None:
    """Write the store's episodes as a dataset (schema: docs/guide/export.md), streamed page by page."""
    import asyncio

    from proxy import export as ex

    if fmt not in ("jsonl", "parquet"):
        raise typer.BadParameter(f"{fmt!r}: jsonl or parquet", param_hint="--format")
    from contract.vocabulary import EpisodeStatus as Statuses

    if status is not None and status not in get_args(Statuses):
        raise typer.BadParameter(f"{status!r}: one of {', '.join(get_args(Statuses))}", param_hint="--status")
    try:
        since_at = ex.parse_since(since) if since is not None else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from exc
    filters = ex.Filters(status=cast("EpisodeStatus | None", status), task=task, since=since_at)
    rows = asyncio.run(_export(_store_url(config), filters, cast("ex.Format", fmt), out, page))
    typer.echo(f"{rows} episodes written to {out}", err=True)


async def _export(url: str, filters: ExportFilters, fmt: ExportFormat, out: Path, page: int) -> int:
    """Stream the export into ``out.partial`` and rename it over ``out`` once complete."""
    from proxy import export as ex
    from proxy.store.repository import Repository

    repo = Repository(url, pool_size=1, sqlite_fast_path=False)
    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[int] = []
    try:
        with partial.open("wb") as fh:
            async for chunk in ex.stream(repo, filters, fmt, page=page, on_page=rows.append):
                fh.write(chunk)
        partial.replace(out)
    finally:
        await repo.close()
        partial.unlink(missing_ok=True)
    return sum(rows)


if __name__ == "__main__":
    cli()
