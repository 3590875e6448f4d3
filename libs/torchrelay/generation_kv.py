"""The generations bucket's reads and writes: a job's current generation by key, read
with compare-and-set revisions (docs/design.md §2). :class:`torchrelay.bus.Bus` has these
methods; a job-scoped credential reads through the bucket's direct get."""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from torchrelay.contract import GENERATIONS_BUCKET, Generation
from torchrelay.errors import BusError, StaleRevision
from torchrelay.provisioning import JetStreamProvisioning


class GenerationStore(JetStreamProvisioning):
    """A connection's generation reads and writes (a base of :class:`~torchrelay.bus.Bus`),
    over the bucket that :class:`JetStreamProvisioning` opens."""

    nc: NatsClient
    job_id: str | None

    async def get_generation(self, job_id: str) -> tuple[Generation, int] | None:
        """The job's current generation and its KV revision, or None if it has none."""
        if self.job_id is not None:
            return await self.get_generation_direct(job_id)
        kv = await self.generations()
        try:
            entry = await kv.get(job_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if entry.value is None:
            return None
        return Generation.model_validate_json(entry.value), int(entry.revision or 0)

    async def get_generation_direct(
        self, job_id: str, timeout: float = 5.0
    ) -> tuple[Generation, int] | None:
        """The job's generation through the bucket's direct get of its key's last value
        (what a job-scoped credential may do; the bucket allows direct gets)."""
        subject = f"$JS.API.DIRECT.GET.KV_{GENERATIONS_BUCKET}.$KV.{GENERATIONS_BUCKET}.{job_id}"
        try:
            msg = await self.nc.request(subject, b"", timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise BusError(f"no direct get on {subject}: the bucket lacks allow_direct") from exc
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == "404" or headers.get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return None
        if status:
            raise BusError(f"direct get of {subject}: {status} {headers.get('Description', '')}")
        revision = int(headers.get("Nats-Sequence", "0") or 0)
        return Generation.model_validate_json(msg.data), revision

    async def put_generation(self, generation: Generation, expected_revision: int | None) -> int:
        """Write a generation with compare-and-set; ``None`` means the key must not exist.

        Raises:
            StaleRevision: the key changed since ``expected_revision`` was read.
        """
        kv = await self.generations()
        data = generation.model_dump_json().encode()
        try:
            if expected_revision is None:
                return int(await kv.create(generation.job_id, data))
            return int(await kv.update(generation.job_id, data, last=expected_revision))
        except (
            nats.js.errors.KeyWrongLastSequenceError,
            nats.js.errors.BadRequestError,
            nats.js.errors.APIError,
        ) as exc:
            raise StaleRevision(
                f"generation of job {generation.job_id} changed since revision "
                f"{expected_revision}: {exc}"
            ) from exc
