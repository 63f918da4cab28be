"""Retention routes (admin key only): delete an episode or a user's episodes on request, purge now,
read the audit log. The rules are the store's (``proxy/store/retention.py``); each deletion and
purge batch writes its audit entry in its own transaction."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Query, Request

from contract.schemas import MAX_STORED_INT, AuditEntryOut, DeletedOut, ListOut, PurgedOut, PurgeIn
from proxy.auth import bearer
from proxy.deps import AdminDep, Services, ServicesDep
from proxy.errors import InvalidRequest
from proxy.gate import canonical_id
from proxy.retention import Sweeper, admin_actor
from proxy.store.retention import Deleted

router = APIRouter(tags=["retention"])
log = logging.getLogger("flywheel.retention")

_REFUSALS: dict[int | str, dict[str, Any]] = {
    404: {"description": "no such episode"},
    409: {"description": "group_leased: an episode to delete is in a group a trainer holds under a live lease"},
}


def _actor(request: Request) -> str:
    headers = request.headers
    return admin_actor(bearer(headers.get("authorization"), headers.get("api-key") or headers.get("x-api-key")))


def _deleted(svc: Services, deleted: Deleted, actor: str) -> DeletedOut:
    for episode_id in deleted.episodes:  # an open one takes no more calls here (the store refuses them anyway)
        svc.gate.closed(episode_id)
    log.info(
        "episodes deleted on request",
        extra={"actor": actor, "episodes": len(deleted.episodes), "calls": deleted.calls, "audit_id": deleted.audit_id},
    )
    return DeletedOut(
        episodes=deleted.episodes,
        forks=deleted.forks,
        calls=deleted.calls,
        groups_deleted=deleted.groups_deleted,
        groups_changed=deleted.groups_changed,
        audit_id=deleted.audit_id,
    )


@router.delete("/episodes/{episode_id}", response_model=DeletedOut, responses=_REFUSALS)
async def delete_episode(episode_id: str, svc: ServicesDep, _: AdminDep, request: Request) -> DeletedOut:
    """Delete an episode from every table: its calls, the episode, the episodes forked from it; its
    group keeps its other members (size and an undecided status follow) or, left empty, is deleted."""
    actor = _actor(request)
    deleted = await svc.repo.retention.delete_episode(canonical_id(episode_id), actor=actor)
    return _deleted(svc, deleted, actor)


@router.delete("/episodes", response_model=DeletedOut, responses={409: _REFUSALS[409]})
async def delete_user(
    svc: ServicesDep,
    _: AdminDep,
    request: Request,
    user: str = Query(
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00]+$",  # PostgreSQL text holds no NUL
        description="every episode whose metadata[retention.user_key] is this string",
    ),
) -> DeletedOut:
    """Delete one user's episodes (those whose ``metadata[retention.user_key]`` is ``user``) and
    their forks, as ``DELETE /episodes/{id}`` deletes one; none is no error."""
    actor = _actor(request)
    deleted = await svc.repo.retention.delete_user(user, key=svc.settings.retention.user_key, actor=actor)
    return _deleted(svc, deleted, actor)


@router.post("/retention/purge", response_model=PurgedOut)
async def purge(svc: ServicesDep, _: AdminDep, request: Request, body: PurgeIn | None = None) -> PurgedOut:
    """Purge now what the sweeper would: bodies and token ids of eligible episodes finished longer
    ago than ``older_than_s`` (default ``retention.bodies_ttl_s``)."""
    older = body.older_than_s if body is not None and body.older_than_s is not None else None
    sweeper = Sweeper(svc.settings.retention, svc.repo)
    older = older if older is not None else sweeper.ttl_s()
    if older is None:
        raise InvalidRequest("retention.bodies_ttl_s is not set: give older_than_s", param="older_than_s")
    total, audits = await sweeper.purge(older, actor=_actor(request))
    return PurgedOut(episodes=total.episodes, calls=total.calls, audit_ids=audits)


@router.get("/retention/audit", response_model=ListOut)
async def audit_log(
    svc: ServicesDep,
    _: AdminDep,
    limit: int = Query(100, ge=1, le=1000),
    before_id: int | None = Query(None, ge=1, le=MAX_STORED_INT),
) -> ListOut:
    """Purges and deletions, newest first: when, who (``admin:<key id>`` or ``retention``), what, how many rows."""
    entries = await svc.repo.retention.audit_log(limit=limit, before_id=before_id)
    return ListOut(
        data=[
            AuditEntryOut(
                id=e.id, at=e.at, actor=e.actor, action=e.action, target=e.target, rows=e.rows, detail=e.detail
            )
            for e in entries
        ]
    )
