"""Trainer API: lease completed groups, acknowledge them with the step that used them, report metrics.

Exactly once: a group is offered only while untrained and unleased (or its lease expired). A
trainer renews its lease while a step runs and once more before it commits the step, and drops the
step if the lease was lost. An ack needs the live lease that holds the group; acking the same step
again is a no-op, so a trainer that crashed after its checkpoint can re-ack safely (renewing
first if the lease lapsed meanwhile; see ``Leases.ack`` in ``store/leases.py``).
"""

from __future__ import annotations

from fastapi import APIRouter, Query

from contract.entities import Claim, Group
from contract.schemas import (
    MAX_STORED_INT,
    AckIn,
    AdmissionOut,
    ClaimIn,
    ListOut,
    ReleaseIn,
    RenewIn,
    RenewOut,
    StepIn,
    TrainerDemandOut,
)
from proxy.deps import AdminDep, ServicesDep

router = APIRouter(prefix="/trainer", tags=["trainer"])


@router.post("/claim", response_model=Claim)
async def claim(body: ClaimIn, svc: ServicesDep, _: AdminDep) -> Claim:
    await svc.adapters.refresh()
    current = svc.adapters.version
    result = await svc.repo.leases.claim(
        owner=body.trainer_id,
        max_groups=body.max_groups,
        lease_s=body.lease_s,
        max_staleness=body.max_staleness,
        current_version=current,
        lease_id=body.lease_id,
        delta=body.calls == "delta",
    )
    svc.admission.claimed(
        body.trainer_id,
        groups_per_step=body.groups_per_step or body.max_groups,
        max_staleness=body.max_staleness,
        mode=body.mode,
        leased=len(result.groups),
    )
    return Claim(
        lease_id=result.lease_id,
        lease_expires_at=result.lease_expires_at,
        current_version=current,
        stale=result.stale,
        groups=[Group.model_validate(g) for g in result.groups],
    )


@router.post("/renew", response_model=RenewOut)
async def renew(body: RenewIn, svc: ServicesDep, _: AdminDep) -> RenewOut:
    """Extend a lease while its step trains; 409 ``lease_lost`` if any of its groups was claimed again."""
    expires = await svc.repo.leases.renew(lease_id=body.lease_id, group_ids=body.group_ids, lease_s=body.lease_s)
    if body.trainer_id is not None:
        svc.admission.renewed(body.trainer_id)
    return RenewOut(lease_id=body.lease_id, lease_expires_at=expires)


@router.post("/ack", response_model=ListOut)
async def ack(body: AckIn, svc: ServicesDep, _: AdminDep) -> ListOut:
    groups = await svc.repo.leases.ack(
        lease_id=body.lease_id,
        group_ids=body.group_ids,
        step=body.step,
        status=body.status,
        reason=body.reason,
        note=body.note,
        audits={e: a.model_dump() for e, a in body.audits.items()} if body.audits else None,
    )
    svc.admission.acked(len(groups))
    return ListOut(data=[Group.model_validate(g) for g in groups])


@router.post("/release")
async def release(body: ReleaseIn, svc: ServicesDep, _: AdminDep) -> dict[str, int]:
    """Give leased, untrained groups back now instead of when the lease expires."""
    return {"released": await svc.repo.leases.release(lease_id=body.lease_id, group_ids=body.group_ids)}


@router.post("/steps", status_code=201)
async def report_step(body: StepIn, svc: ServicesDep, _: AdminDep) -> dict[str, object]:
    record = await svc.repo.steps.add(step=body.step, metrics=body.metrics)
    return {"step": record.step, "metrics": record.metrics, "created_at": record.created_at}


@router.get("/steps", response_model=ListOut)
async def list_steps(
    svc: ServicesDep,
    _: AdminDep,
    since_step: int = Query(-1, ge=-1, le=MAX_STORED_INT),
    limit: int = Query(1000, ge=1, le=10000),
) -> ListOut:
    steps = await svc.repo.steps.list(since_step=since_step, limit=limit)
    return ListOut(data=[{"step": s.step, "metrics": s.metrics, "created_at": s.created_at} for s in steps])


@router.get("/admission", response_model=AdmissionOut)
async def admission(svc: ServicesDep, _: AdminDep) -> AdmissionOut:
    """The admission picture: limit, backlog, refusals, the trainers' demand, and every group by outcome."""
    state = await svc.admission.state()
    now = svc.admission.clock()
    return AdmissionOut(
        enabled=state.enabled,
        limit=state.limit,
        backlog=state.backlog,
        settling=state.settling,
        refused=state.refused,
        trainers={
            name: TrainerDemandOut(
                groups_per_step=d.groups_per_step,
                max_staleness=d.max_staleness,
                mode=d.mode,
                seconds_per_step=None if d.step_s is None else round(d.step_s, 3),
                seconds_since_seen=round(now - d.seen, 3),
            )
            for name, d in state.trainers.items()
        },
        groups=await svc.repo.episodes.count_groups(),
    )
