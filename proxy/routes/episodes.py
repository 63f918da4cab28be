"""Control API: groups, episodes, rewards. Admin key only: an agent must never reward itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from contract.entities import CreatedEpisode, CreatedGroup, Episode, EpisodeKey, Group
from contract.schemas import (
    MAX_STORED_INT,
    AbandonIn,
    EpisodeCreate,
    FiniteFloat,
    ForkIn,
    GroupCreate,
    Limit,
    ListOut,
    RewardIn,
)
from contract.vocabulary import EpisodeStatus, GroupStatus, SkipCount, TrainStatus
from proxy.deps import AdminDep, ServicesDep
from proxy.errors import BacklogFull, InvalidRequest
from proxy.gate import canonical_id
from proxy.routes.policy import decided
from proxy.store.records import GroupRecord

router = APIRouter(tags=["episodes"])
MAX_TASK_IDS = 256
"""Task ids one ``GET /episodes`` filters by: a query string stays well inside a server's line limit."""


def _public_url(svc: ServicesDep, request: Request) -> str:
    """Where agents reach this proxy: ``public_url`` if set, else the URL this request came in on
    (so a proxy bound to 0.0.0.0 hands out an address clients can actually use)."""
    if svc.settings.public_url:
        return svc.settings.public_url.rstrip("/")
    return str(request.base_url).rstrip("/")


def _key(svc: ServicesDep, request: Request, episode_id: str) -> EpisodeKey:
    return EpisodeKey(
        id=episode_id,
        api_key=svc.keys.episode_key(episode_id),
        base_url=f"{_public_url(svc, request)}/episodes/{episode_id}/v1",
    )


def _check_size(svc: ServicesDep, size: int) -> None:
    if size > svc.settings.episodes.max_group_size:
        raise InvalidRequest(f"size {size} exceeds the limit {svc.settings.episodes.max_group_size}", param="size")


def _check_teachers(
    svc: ServicesDep, metadata: dict[str, Any], episode_metadata: list[dict[str, Any]] | None = None
) -> None:
    """A ``source: teacher:<name>`` must name a teacher this proxy serves (400 ``unknown_teacher``,
    nothing written; ``proxy/teachers.py``)."""
    if svc.relay.teachers is not None:
        svc.relay.teachers.check(metadata, episode_metadata)


async def _admitted(svc: ServicesDep, request: Request, create: Callable[[], Awaitable[GroupRecord]]) -> CreatedGroup:
    """Create a group under admission control (429 ``backlog_full``, counted), with each episode's
    key and base URL: what ``POST /groups`` and a fork answer alike."""
    try:
        async with svc.admission.admit():
            group = await create()
    except BacklogFull:
        svc.metrics.admission_refused.inc()
        raise
    svc.metrics.episodes.labels("created").inc(group.size)
    return CreatedGroup.model_validate(
        {
            **Group.model_validate(group).model_dump(),
            "episode_keys": [_key(svc, request, e.id) for e in group.episodes or []],
        }
    )


@router.post(
    "/groups",
    status_code=201,
    response_model=CreatedGroup,
    responses={429: {"description": "backlog_full: the trainer cannot take another group before it goes stale"}},
)
async def create_group(body: GroupCreate, svc: ServicesDep, _: AdminDep, request: Request) -> CreatedGroup:
    """Create a group of ``size`` episodes for one task, each with its own key and base URL.
    Refused with 429 ``backlog_full`` and ``Retry-After`` while the groups ahead of the trainer
    already fill its staleness window (``proxy/admission.py``)."""
    _check_size(svc, body.size)
    _check_teachers(svc, body.metadata, body.episode_metadata)
    if body.episode_metadata is not None and len(body.episode_metadata) != body.size:
        raise InvalidRequest(
            f"episode_metadata has {len(body.episode_metadata)} entries; size is {body.size}", param="episode_metadata"
        )

    async def create() -> GroupRecord:
        group = await svc.repo.episodes.create_group(
            task_id=body.task_id, size=body.size, metadata=body.metadata, episode_metadata=body.episode_metadata
        )
        svc.adapters.assigned([(e.id, e.policy_arm, e.canary_version) for e in group.episodes or []])
        return group

    return await _admitted(svc, request, create)


@router.post(
    "/episodes/{episode_id}/fork",
    status_code=201,
    response_model=CreatedGroup,
    responses={
        409: {"description": "the episode is open or abandoned: only a rewarded episode is forked"},
        429: {"description": "backlog_full, as for POST /groups"},
    },
)
async def fork_episode(episode_id: str, body: ForkIn, svc: ServicesDep, _: AdminDep, request: Request) -> CreatedGroup:
    """A fork group: ``size`` episodes of the source's task whose first ``at`` answered calls are
    answered from the source's record (``proxy/replay.py``); run the same agent on each, unchanged."""
    _check_size(svc, body.size)
    _check_teachers(svc, body.metadata)
    source = canonical_id(episode_id)
    return await _admitted(
        svc,
        request,
        lambda: svc.repo.forks.create(
            source, at=body.at, size=body.size, rule=body.on_divergence, metadata=body.metadata
        ),
    )


@router.get("/groups", response_model=ListOut)
async def list_groups(
    svc: ServicesDep,
    _: AdminDep,
    status: GroupStatus | None = None,
    task_id: str | None = None,
    train_status: TrainStatus | None = None,
    train_reason: Annotated[
        SkipCount | None, Query(description="never trained for this reason; other: skipped or stale without one")
    ] = None,
    leased: bool | None = None,  # true: under a trainer's live lease; false: not (what the runner waits on)
    limit: Limit = 100,
    offset: int = Query(0, ge=0, le=MAX_STORED_INT),
) -> ListOut:
    groups = await svc.repo.episodes.list_groups(
        status=status,
        task_id=task_id,
        train_status=train_status,
        train_reason=train_reason,
        leased=leased,
        limit=limit,
        offset=offset,
    )
    return ListOut(data=[Group.model_validate(g) for g in groups])


@router.get("/groups/skips", response_model=dict[SkipCount, int])
async def skip_counts(svc: ServicesDep, _: AdminDep) -> dict[SkipCount, int]:
    """Groups never trained (``skipped`` or ``stale``) counted by ``train_reason`` (``other``: none
    stored), in one query; the launcher's report reads its skips from it."""
    return await svc.repo.episodes.skip_counts()


@router.get("/groups/{group_id}", response_model=Group)
async def get_group(group_id: str, svc: ServicesDep, _: AdminDep) -> Group:
    return Group.model_validate(await svc.repo.episodes.get_group(canonical_id(group_id, param="group_id")))


@router.post("/episodes", status_code=201, response_model=CreatedEpisode)
async def create_episode(body: EpisodeCreate, svc: ServicesDep, _: AdminDep, request: Request) -> CreatedEpisode:
    """Create a lone episode (no group): recorded like any other, never trained on by GRPO."""
    _check_teachers(svc, body.metadata)
    episode = await svc.repo.episodes.create_episode(task_id=body.task_id, metadata=body.metadata)
    svc.adapters.assigned([(episode.id, episode.policy_arm, episode.canary_version)])  # its canary arm, if any
    svc.metrics.episodes.labels("created").inc()
    key = _key(svc, request, episode.id)
    return CreatedEpisode.model_validate(
        {**Episode.model_validate(episode).model_dump(), "api_key": key.api_key, "base_url": key.base_url}
    )


@router.get("/episodes", response_model=ListOut)
async def list_episodes(
    svc: ServicesDep,
    _: AdminDep,
    status: EpisodeStatus | None = None,
    group_id: str | None = None,
    task_id: Annotated[
        list[str] | None, Query(description=f"exact task ids, repeated for a set (any of them); at most {MAX_TASK_IDS}")
    ] = None,
    min_reward: Annotated[
        FiniteFloat | None, Query(description="rewarded at least this (episodes without a reward: out)")
    ] = None,
    source: Annotated[
        str | None,
        Query(min_length=1, max_length=256, description='metadata["source"] equals this string (the source tag)'),
    ] = None,
    limit: Limit = 100,
    offset: int = Query(0, ge=0, le=MAX_STORED_INT),
) -> ListOut:
    """Episodes, newest first, without their calls (``GET /episodes/{id}`` has them). The filters
    combine (all must hold); the trainer's warm start selects its episodes with them."""
    if task_id is not None and len(task_id) > MAX_TASK_IDS:
        raise InvalidRequest(f"{len(task_id)} task ids; at most {MAX_TASK_IDS} in one query", param="task_id")
    episodes = await svc.repo.episodes.list_episodes(
        status=status,
        group_id=canonical_id(group_id, param="group_id") if group_id else None,
        task_ids=task_id,
        min_reward=min_reward,
        source=source,
        limit=limit,
        offset=offset,
    )
    return ListOut(data=[Episode.model_validate(e) for e in episodes])


@router.get("/episodes/{episode_id}", response_model=Episode)
async def get_episode(
    episode_id: str, svc: ServicesDep, _: AdminDep, calls: bool = Query(True, description="include the recorded calls")
) -> Episode:
    return Episode.model_validate(await svc.repo.episodes.get_episode(canonical_id(episode_id), with_calls=calls))


@router.post("/episodes/{episode_id}/reward", response_model=Episode)
async def reward_episode(episode_id: str, body: RewardIn, svc: ServicesDep, _: AdminDep) -> Episode:
    """Finish an episode with its reward. The same payload again is a no-op; a different one is 409.
    An episode of a running canary's test takes only a reward in the test's range (400
    ``reward_out_of_range``), and its reward may decide the canary."""
    episode, changed = await svc.repo.episodes.set_reward(
        canonical_id(episode_id), reward=body.reward, call_rewards=body.call_rewards, metadata=body.metadata
    )
    svc.gate.closed(episode.id)
    if changed:
        svc.metrics.episodes.labels("rewarded").inc()
    if episode.canary_decided is not None:  # this reward decided its canary (proxy/store/canaries.py)
        await decided(svc, episode.canary_decided)
    return Episode.model_validate(episode)


@router.post(
    "/episodes/{episode_id}/await_reward",
    response_model=Episode,
    responses={409: {"description": "episode_rewarded / episode_abandoned: it is finished already"}},
)
async def await_reward(episode_id: str, svc: ServicesDep, _: AdminDep) -> Episode:
    """The agent is done and its reward comes late (a review, a slow judge): the episode takes no
    more model calls (409 ``episode_closed``), is never abandoned for idling, and is no traffic for
    admission; a reward posted hours or days later still completes its group. ``late_rewards.max_wait_s``
    bounds the wait. Again on an awaiting episode: a no-op."""
    episode, changed = await svc.repo.episodes.await_reward(canonical_id(episode_id))
    svc.gate.closed(episode.id)
    if changed:
        svc.metrics.episodes.labels("awaiting").inc()
    return Episode.model_validate(episode)


@router.post("/episodes/{episode_id}/abandon", response_model=Episode)
async def abandon_episode(episode_id: str, body: AbandonIn, svc: ServicesDep, _: AdminDep) -> Episode:
    """Finish an episode without a reward (the agent failed): it never enters training."""
    episode = await svc.repo.episodes.abandon(canonical_id(episode_id), reason=body.reason, cause=body.cause)
    svc.gate.closed(episode.id)
    svc.metrics.episodes.labels("abandoned").inc()
    return Episode.model_validate(episode)
