"""Policy API: the current adapter version, and publishing a new one (the trainer calls this)."""

from __future__ import annotations

from fastapi import APIRouter

from contract.entities import PolicyVersion
from contract.schemas import ListOut, PublishIn
from contract.vocabulary import BASE_VERSION
from proxy.deps import AdminDep, ServicesDep

router = APIRouter(prefix="/policy", tags=["policy"])


@router.get("", response_model=PolicyVersion)
async def current_policy(svc: ServicesDep, _: AdminDep) -> PolicyVersion:
    """The version the policy aliases route to now (version 0, the base model, before any publish)."""
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


@router.post("/publish", status_code=201, response_model=PolicyVersion)
async def publish(body: PublishIn, svc: ServicesDep, _: AdminDep) -> PolicyVersion:
    """Load the adapter on every replica as ``policy-v{N}``, switch routing to it, unload old ones."""
    record = await svc.adapters.publish(adapter_path=body.adapter_path, version=body.version, metadata=body.metadata)
    svc.metrics.policy_version.set(record.version)
    svc.admission.published()
    return PolicyVersion.model_validate(record)
