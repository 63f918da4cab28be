"""The trainer's per-episode fidelity audit: sent with an ack, kept on the episode, shown on its
page and in the export (in-process app on SQLite and PostgreSQL; no model call is made)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.proxy.conftest import ADMIN, make_settings, new_group, running_app


def _audit(**fields: Any) -> dict[str, Any]:
    return {
        "step": 3,
        "calls": 3,
        "calls_failed": 0,
        "calls_deduped": 1,
        "calls_context_only": 0,
        "calls_merged": 1,
        "breaks": 0,
        "samples": 1,
        "samples_truncated": 0,
        "tokens_trained": 40,
        "tokens_under_grammar": 12,
        "tokens_forced": 5,
        "gap_mean": 0.25,
        "gap_max": 1.5,
        "gap_tokens": 40,
        **fields,
    }


async def _claimed(client: httpx.AsyncClient) -> tuple[str, list[dict[str, Any]]]:
    groups = [await new_group(client), await new_group(client)]
    for group in groups:
        for key, reward in zip(group["episode_keys"], (1.0, 0.0), strict=True):
            response = await client.post(f"/episodes/{key['id']}/reward", json={"reward": reward}, headers=ADMIN)
            assert response.status_code == 200, response.text
    claim = (await client.post("/trainer/claim", json={"trainer_id": "t", "max_groups": 2}, headers=ADMIN)).json()
    assert len(claim["groups"]) == 2
    return claim["lease_id"], groups


async def test_an_ack_keeps_each_episodes_audit_for_the_page_and_the_export(store_url: str) -> None:
    async with running_app(make_settings(store_url)) as client:
        lease, (mine, other) = await _claimed(client)
        ids = [k["id"] for k in mine["episode_keys"]]
        ack = {"lease_id": lease, "group_ids": [mine["id"]], "step": 3}

        # An audit naming an episode of a group this ack does not cover refuses the whole ack.
        foreign = {**ack, "audits": {ids[0]: _audit(), other["episode_keys"][0]["id"]: _audit()}}
        refused = await client.post("/trainer/ack", json=foreign, headers=ADMIN)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "audits"
        assert (await client.get(f"/groups/{mine['id']}", headers=ADMIN)).json()["train_status"] == "pending"
        bad = await client.post("/trainer/ack", json={**ack, "audits": {ids[0]: _audit(calls=-1)}}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"

        done = await client.post("/trainer/ack", json={**ack, "audits": {ids[0]: _audit()}}, headers=ADMIN)
        assert done.status_code == 200, done.text
        first, second = [(await client.get(f"/episodes/{i}", headers=ADMIN)).json() for i in ids]
        assert first["train_audit"] == _audit() and second["train_audit"] is None

        page = await client.get(f"/ui/episodes/{ids[0]}", headers=ADMIN)
        assert page.status_code == 200
        assert "<h2>Fidelity</h2>" in page.text and "trained at step</dt><dd>3: 1 sample," in page.text
        assert "0.25 nats mean" in page.text and "1 retries dropped" in page.text
        untrained = await client.get(f"/ui/episodes/{ids[1]}", headers=ADMIN)
        assert "not trained yet" in untrained.text

        export = await client.get("/ui/export", params={"format": "jsonl"}, headers=ADMIN)
        rows = {row["episode_id"]: row for row in map(json.loads, export.text.splitlines())}
        fidelity = json.loads(rows[ids[0]]["fidelity"])
        assert fidelity["trainer"] == _audit() and fidelity["calls"] == 0 and fidelity["splice_skipped"] == {}
        assert json.loads(rows[ids[1]]["fidelity"])["trainer"] is None
