"""A job across hosts, on one machine the way it runs on many: one network namespace per
host, one ``torchrelay run`` launcher in each, the control plane reached over a bridge.

Three worker hosts of two ranks and one spare host of two hot spares. Each faulty run ends
bitwise equal to the fault-free run of the same layout: a SIGKILLed rank and then an XID on
another host's GPU, a whole worker host killed (its launcher and node agent included), and a
worker host cut off the network for 30 s (its processes must find themselves fenced and exit
when it comes back).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conformance.matrix import cpu_load
from tests.harness import Stack, digests, wait_until
from tests.helpers.multihost import (
    PER_HOST,
    SPARE_HOST,
    WORKER_HOSTS,
    Cluster,
    Job,
    api_get,
    chaos,
    closed,
    cluster_at,
    incidents,
    start_at_step,
    start_job,
    wait_launchers,
)
from torchrelay import netns
from torchrelay.contract import EXIT_FENCED
from torchrelay.launcher import EXIT_HOST_REFUSED

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    with cluster_at(tmp_path_factory.mktemp("multihost")) as made:
        yield made


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> dict[int, str]:
    job = start_job(cluster, "mh-reference", spares=False)
    wait_launchers(job, WORKER_HOSTS)
    ref = digests(job.out)
    assert sorted(ref) == list(range(len(WORKER_HOSTS) * PER_HOST)), job.all_logs()
    return ref


def _assert_migrated(stack: Stack, job: Job, count: int) -> list[dict[str, Any]]:
    done = wait_until(lambda: closed(stack, job.job_id, count), 60, f"{count} incident(s)")
    assert len(done) == count, done
    for incident in done:
        assert incident["resolution"] == "migrated_live", (incident, job.all_logs())
    assert len({i["rank"] for i in done}) == count, done  # one incident per lost rank
    return done


def test_a_host_that_comes_after_the_job_formed_is_refused_with_exit_3(
    cluster: Cluster, reference: dict[int, str]
) -> None:
    late = start_job(cluster, "mh-reference", spares=False, hosts=["hs"], nnodes=3)
    assert late.launchers["hs"].wait(120) == EXIT_HOST_REFUSED, late.all_logs()
    assert "host hs is late" in late.log("hs"), late.log("hs")


def test_a_sigkilled_rank_and_a_gpu_fault_each_move_one_rank_to_the_spare_host(
    cluster: Cluster, reference: dict[int, str]
) -> None:
    stack = cluster.stack
    job = start_at_step(cluster, "mh-kill", 15)
    chaos(stack, "kill", "--job", job.job_id, "--rank", "3")
    [killed] = _assert_migrated(stack, job, 1)
    assert (killed["rank"], killed["node"]) == (3, "h1")
    # The node agent of h0 reports its node as h0, the name its launcher gave its ranks:
    # an XID on (h0, gpu 1) is rank 1's, and only rank 1 moves (to the second spare).
    chaos(stack, "xid", "--node", "h0", "--gpu", "1", "--code", "79")
    wait_launchers(job, [*WORKER_HOSTS, SPARE_HOST])
    done = _assert_migrated(stack, job, 2)
    [xid] = [i for i in done if i["incident_id"] != killed["incident_id"]]
    assert (xid["rank"], xid["node"], xid["gpu"]) == (1, "h0", 1)
    assert digests(job.out) == reference


def test_the_loss_of_a_whole_host_under_cpu_load_moves_its_ranks_to_the_spare_host(
    cluster: Cluster, reference: dict[int, str]
) -> None:
    # On a busy machine (busy-loop processes on every core): a live host's late beats must
    # not pass for a lost host.
    stack = cluster.stack
    with cpu_load("hogs"):
        job = start_at_step(cluster, "mh-hostloss", 15)
        assert cluster.net.kill_host("h1"), "h1 ran nothing"
        survivors = [h for h in WORKER_HOSTS if h != "h1"]
        wait_launchers(job, [*survivors, SPARE_HOST])
    done = _assert_migrated(stack, job, PER_HOST)
    assert sorted(i["rank"] for i in done) == [2, 3]
    assert {i["node"] for i in done} == {"h1"}
    assert digests(job.out) == reference


@pytest.mark.skipif(
    os.environ.get("TORCHRELAY_E2E") != "all",
    reason="make e2e runs it (TORCHRELAY_E2E=all): its 30 s cut is make test's budget",
)
def test_a_partitioned_host_is_replaced_and_its_processes_exit_fenced(
    cluster: Cluster, reference: dict[int, str]
) -> None:
    stack = cluster.stack
    job = start_at_step(cluster, "mh-partition", 15)
    cluster.net.partition("h2")
    cut_at = time.monotonic()
    try:
        done = _assert_migrated(stack, job, PER_HOST)
        assert sorted(i["rank"] for i in done) == [4, 5]
        time.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))
    finally:
        cluster.net.heal("h2")
    wait_launchers(job, [*WORKER_HOSTS, SPARE_HOST])
    assert digests(job.out) == reference
    # The cut-off processes came back to a newer generation and were fenced: they exit on
    # their own (EXIT_FENCED), by their launcher's hand on the executor's fence order, or
    # stopped by it at the job's end (the launcher's summary names each one's end).
    log = job.log("h2")
    for member in ("mh-partition-w4", "mh-partition-w5"):
        [end] = [line.split() for line in log.splitlines() if f" {member} worker h2/" in line]
        assert end[3] == "fenced", log
        assert " ".join(end[4:]) in (
            f"(exit code {EXIT_FENCED})",
            "(killed by SIGKILL)",
            "(killed by SIGTERM)",
        ), log
    assert not cluster.net.pids("h2"), "processes of h2 still run after the job"
    assert len(incidents(stack, job.job_id)) == PER_HOST
    # One truth: a generation per migration, and the job's last ranks on the spare host.
    info = api_get(stack, f"/v1/jobs/{job.job_id}")
    assert info["generation"] == 1 + PER_HOST, info
    assert {r["node"] for r in info["ranks"] if r["rank"] in (4, 5)} == {SPARE_HOST}, info
    assert len({r["rank"] for r in info["ranks"]}) == len(info["ranks"]) == 6, info
