"""JetStream's streams, generations bucket and durable consumers: created by the one identity
allowed to administer JetStream (``admin``: ``torchrelay up``, ``torchrelay provision``),
checked by everyone else (docs/security.md). :class:`torchrelay.bus.Bus` has these methods.
"""

from __future__ import annotations

import contextlib

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from torchrelay.contract import CONSUMERS, GENERATIONS_BUCKET, STREAMS, ConsumerSpec
from torchrelay.errors import BusError


class JetStreamProvisioning:
    """Provisioning and checks of a connection (a mixin of :class:`~torchrelay.bus.Bus`)."""

    js: JetStreamContext
    user: str
    _kv: KeyValue | None
    _replicas: int

    async def provision(self, replicas: int = 1) -> None:
        """Create or update every stream, the generations bucket and every durable consumer
        (idempotent): ``torchrelay up`` and ``torchrelay provision`` do it as ``admin``, the
        only identity that may administer JetStream when authentication is on."""
        await self.provision_streams(replicas)
        for spec in CONSUMERS.values():
            await self.provision_consumer(spec)

    async def ensure_provisioned(self, replicas: int = 1) -> None:
        """Check that the streams and the generations bucket exist, creating them only where
        they are missing (an open server; a restricted role cannot and is told how to).

        Raises:
            BusError: something is missing and this connection may not create it.
        """
        missing = []
        for spec in STREAMS:
            try:
                await self.js.stream_info(spec.name)
            except nats.js.errors.NotFoundError:
                missing.append(spec.name)
            except (nats.errors.TimeoutError, TimeoutError):
                # No permission to look (or no JetStream): it is checked where it is used.
                continue
        if not missing:
            await self._bind_generations()
            return
        try:
            await self.provision_streams(replicas)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise BusError(_not_provisioned(", ".join(missing), self.user, exc)) from exc

    async def _bind_generations(self) -> None:
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            await self.generations()

    async def ensure_consumer(self, spec: ConsumerSpec) -> None:
        """The durable consumer of ``spec``: found, or created where this connection may.

        Raises:
            BusError: it is missing and this connection may not create it.
        """
        try:
            await self.js.consumer_info(spec.stream, spec.durable)
            return
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise BusError(
                _not_provisioned(f"consumer {spec.durable} of {spec.stream}", self.user, exc)
            ) from exc
        try:
            await self.provision_consumer(spec)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise BusError(
                _not_provisioned(f"consumer {spec.durable} of {spec.stream}", self.user, exc)
            ) from exc

    async def provision_streams(self, replicas: int = 1) -> None:
        """Create or update the streams and the generations KV bucket (idempotent)."""
        for spec in STREAMS:
            cfg = StreamConfig(
                name=spec.name,
                subjects=list(spec.subjects),
                storage=StorageType.FILE,
                num_replicas=replicas,
                duplicate_window=spec.duplicate_window_s,
                max_age=spec.max_age_s,
            )
            try:
                await self.js.add_stream(cfg)
            except nats.js.errors.BadRequestError:
                await self.js.update_stream(cfg)
        self._replicas = replicas
        await self.generations()

    async def generations(self) -> KeyValue:
        """The job-generations KV bucket (created on first use)."""
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(GENERATIONS_BUCKET)
            except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
                self._kv = await self.js.create_key_value(
                    KeyValueConfig(
                        bucket=GENERATIONS_BUCKET,
                        history=16,
                        storage=StorageType.FILE,
                        replicas=self._replicas,
                        direct=True,
                    )
                )
        return self._kv

    async def provision_consumer(self, spec: ConsumerSpec) -> None:
        """Create the durable consumer of ``spec`` (explicit ack, bounded redelivery)."""
        cfg = ConsumerConfig(
            durable_name=spec.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver,
            backoff=list(spec.backoff_s),
            filter_subjects=list(spec.filter_subjects),
            max_ack_pending=spec.max_ack_pending,
        )
        await self.js.add_consumer(spec.stream, cfg)


def _not_provisioned(what: str, user: str | None, exc: BaseException) -> str:
    return (
        f"JetStream {what} is missing (or hidden from NATS user {user or '(anonymous)'}, "
        f"which may not create it: {exc!r}); provision the stack first (`torchrelay up` does, or "
        "`torchrelay provision` with the admin credential)"
    )


__all__ = ["JetStreamProvisioning"]
