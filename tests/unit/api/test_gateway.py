"""The gateway to the services: error mapping and shared round trips, on real NATS."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.api.gateway import ApiProblem, Gateway, not_found
from torchrelay.bus import Bus, Conflict, NotFound, RequestInvalid


async def test_concurrent_identical_reads_share_one_request(bus: Bus) -> None:
    calls: list[dict[str, Any]] = []

    async def incident_list(body: dict[str, Any]) -> Any:
        calls.append(body)
        await asyncio.sleep(0.3)  # long enough for every caller below to arrive
        return {"items": [{"n": len(calls)}], "next_cursor": None}

    await bus.serve("scheduler", "incident_list", incident_list)
    gw = Gateway(bus, timeout_s=5)
    results = await asyncio.gather(
        *(gw.call("scheduler", "incident_list", {"limit": 5}) for _ in range(5)),
        gw.call("scheduler", "incident_list", {"limit": 6}),
    )
    assert sorted(c["limit"] for c in calls) == [5, 6]  # five callers, one request
    assert all(r == results[0] for r in results[:5])
    # A read that starts after the shared one answered asks again: nothing is cached.
    await gw.call("scheduler", "incident_list", {"limit": 5})
    assert len(calls) == 3


async def test_one_caller_leaving_does_not_cancel_the_others(bus: Bus) -> None:
    release = asyncio.Event()

    async def job_list(body: dict[str, Any]) -> Any:
        await release.wait()
        return {"items": [], "next_cursor": None}

    await bus.serve("scheduler", "job_list", job_list)
    gw = Gateway(bus, timeout_s=5)
    leaver = asyncio.create_task(gw.call("scheduler", "job_list", {}))
    stayer = asyncio.create_task(gw.call("scheduler", "job_list", {}))
    await asyncio.sleep(0.05)
    leaver.cancel()
    release.set()
    assert (await stayer)["items"] == []


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (NotFound("no such job", "job_id"), 404),
        (RequestInvalid("bad cursor", "cursor"), 422),
        (Conflict("term not over", "contract_id"), 409),
        (RuntimeError("boom"), 502),
    ],
)
async def test_service_errors_become_problems(bus: Bus, error: Exception, status: int) -> None:
    async def job_get(body: dict[str, Any]) -> Any:
        raise error

    await bus.serve("scheduler", "job_get", job_get)
    with pytest.raises(ApiProblem) as err:
        await Gateway(bus, timeout_s=5).call("scheduler", "job_get", {"job_id": "j"})
    assert err.value.status == status
    if status != 502:
        assert err.value.field == error.field  # type: ignore[attr-defined]
    else:
        assert err.value.service == "scheduler"


async def test_missing_replaces_not_found_and_silence_is_503(bus: Bus) -> None:
    async def job_get(body: dict[str, Any]) -> Any:
        raise NotFound("job j is not registered", "job_id")

    await bus.serve("scheduler", "job_get", job_get)
    gw = Gateway(bus, timeout_s=1)
    with pytest.raises(ApiProblem) as err:
        await gw.call(
            "scheduler", "job_get", {"job_id": "j"}, missing=not_found("job", "j", "job_id")
        )
    assert err.value.detail == "job 'j' does not exist"
    with pytest.raises(ApiProblem) as err:
        await gw.call("billing", "contract_get", {"contract_id": "c"})
    assert err.value.status == 503
    assert err.value.service == "billing"
