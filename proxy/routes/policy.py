"""Policy API: the current adapter version, publishing a new one (the trainer calls this), and the
canary rollout of a published one (``proxy/store/canaries.py``): its state, manual promote and rollback."""

from __future__ import annotations

from fastapi import APIRouter

from contract.entities import PolicyVersion
from contract.schemas import CanaryOut, CanaryStateOut, ListOut, PublishIn
from contract.vocabulary import BASE_VERSION
from proxy.deps import AdminDep, Services, ServicesDep
from proxy.store.models import Decided
from proxy.store.records import CanaryRecord

router = APIRouter(prefix="/policy", tags=["policy"])


@router.get("", response_model=PolicyVersion)
async def current_policy(svc: ServicesDep, _: AdminDep) -> PolicyVersion:
    """The version the policy aliases route to now (version 0, the base model, before any publish);
    a running canary serves only its arm's episodes and is not this version."""
    await svc.adapters.refresh()
    current = svc.adapters.current
    if current is None:
        return PolicyVersion(
            version=BASE_VERSION, name=svc.settings.policy.base_model, adapter_path="", created_at=0.0, metadata={}
        )
    return PolicyVersion.model_validate(current)


@router.get("/versions", response_model=ListOut)
async def policy_versions(svc: ServicesDep, _: AdminDep) -> ListOut:
    return ListOut(data=[PolicyVersion.model_validate(v) for v in await svc.repo.versions.list()])


@router.post(
    "/publish",
    status_code=201,
    response_model=PolicyVersion,
    responses={409: {"description": "version_conflict; canary_pending: a canary runs, decide it first"}},
)
async def publish(body: PublishIn, svc: ServicesDep, _: AdminDep) -> PolicyVersion:
    """Load the adapter on every replica as ``policy-v{N}``, switch routing to it, unload old ones.
    With ``policy.canary.share`` above 0 and a current version, it starts as the canary instead:
    that share of new episodes gets it until the test (or an admin) promotes or rolls it back."""
    record = await svc.adapters.publish(adapter_path=body.adapter_path, version=body.version, metadata=body.metadata)
    routed(svc)
    svc.admission.published()
    return PolicyVersion.model_validate(record)


@router.get("/canary", response_model=CanaryStateOut)
async def canary_state(svc: ServicesDep, _: AdminDep) -> CanaryStateOut:
    """The running canary (None when none runs) with the test's evidence on its rewards so far, and
    past decisions with the evidence each was made on."""
    await svc.adapters.refresh()
    routed(svc)
    running = await svc.repo.versions.canaries.running()
    return CanaryStateOut(
        share=svc.settings.policy.canary.share,
        current_version=svc.adapters.version,
        running=CanaryOut.model_validate(running[0]) if running else None,
        evidence=running[1].evidence() if running else None,
        decisions=[CanaryOut.model_validate(d) for d in await svc.repo.versions.canaries.decided()],
    )


async def _decide(svc: Services, verdict: Decided) -> CanaryOut:
    record = await svc.repo.versions.canaries.decide(verdict)
    await decided(svc, record)
    return CanaryOut.model_validate(record)


@router.post(
    "/canary/promote", response_model=CanaryOut, responses={409: {"description": "no_canary: none is running"}}
)
async def promote_canary(svc: ServicesDep, _: AdminDep) -> CanaryOut:
    """Make the running canary the current version now, whatever the test says (recorded as manual)."""
    return await _decide(svc, "promote")


@router.post(
    "/canary/rollback", response_model=CanaryOut, responses={409: {"description": "no_canary: none is running"}}
)
async def rollback_canary(svc: ServicesDep, _: AdminDep) -> CanaryOut:
    """Retire the running canary now (recorded as manual): no call goes to it any more."""
    return await _decide(svc, "rollback")


def routed(svc: Services) -> None:
    """The routing gauges from this process's table."""
    svc.metrics.policy_version.set(svc.adapters.version)
    canary = svc.adapters.canary
    svc.metrics.canary_version.set(canary.version if canary else 0)


async def decided(svc: Services, record: CanaryRecord) -> None:
    """A decision this process recorded: counted, and routed at once (other processes on refresh)."""
    svc.metrics.canary_decisions.labels(record.verdict or "", str(bool(record.manual)).lower()).inc()
    await svc.adapters.refresh()
    routed(svc)
