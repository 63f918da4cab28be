"""Trainer steps: each step's metrics as the trainer reported them (the dashboard's charts)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from proxy.store.models import TrainerStep
from proxy.store.records import TrainerStepRecord
from proxy.store.sessions import Sessions


class Steps:
    """The trainer steps aggregate; each public method is one transaction."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def add(self, *, step: int, metrics: dict[str, Any]) -> TrainerStepRecord:
        """Store a step's metrics; a retried report of the same step replaces the first."""
        async with self._sessions.write() as session:
            row = await session.get(TrainerStep, step)
            if row is None:
                row = TrainerStep(step=step, metrics=metrics, created_at=time.time())
                session.add(row)
            else:
                row.metrics = metrics
        return TrainerStepRecord(step=row.step, metrics=row.metrics, created_at=row.created_at)

    # Last in the class: below a method named ``list``, mypy reads ``list[...]`` as that method.
    async def list(self, *, since_step: int = -1, limit: int = 1000) -> list[TrainerStepRecord]:
        """Steps after ``since_step``, oldest first."""
        async with self._sessions.read() as session:
            rows = (
                await session.scalars(
                    select(TrainerStep).where(TrainerStep.step > since_step).order_by(TrainerStep.step).limit(limit)
                )
            ).all()
        return [TrainerStepRecord(step=r.step, metrics=r.metrics, created_at=r.created_at) for r in rows]
