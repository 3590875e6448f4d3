"""Observability: structured logs, OpenTelemetry tracing carried in NATS headers, Prometheus.

One failure is one trace: publishers inject W3C trace context into message headers and
consumers continue it, so the spans of detector, scheduler, executor and billing line up.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from prometheus_client import CollectorRegistry, Counter, Histogram

_configured_tracing = False


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""

    _skip = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            out["trace_id"] = f"{span.trace_id:032x}"
        for key, value in record.__dict__.items():
            if key not in self._skip and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(service: str, level: str = "INFO", as_json: bool = True) -> logging.Logger:
    """Configure the root logger once for a process; return the service's logger."""
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if as_json
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("nats", "asyncio", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"torchrelay.{service}")


class FileSpanExporter(SpanExporter):
    """Appends finished spans as JSON lines to a file (local debugging and the e2e tests)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            parent = span.parent
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name"),
                        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
                        "span_id": f"{ctx.span_id:016x}" if ctx else None,
                        "parent_id": f"{parent.span_id:016x}" if parent else None,
                        "start": span.start_time,
                        "end": span.end_time,
                        "attributes": dict(span.attributes or {}),
                    },
                    default=str,
                )
            )
        with open(self._path, "a") as out:
            out.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def configure_tracing(
    service: str,
    otlp_endpoint: str | None = None,
    exporter: SpanExporter | None = None,
    trace_file: str | None = None,
) -> TracerProvider:
    """Install a tracer provider for this process, exporting via OTLP when configured.

    Args:
        service: the ``service.name`` resource attribute.
        otlp_endpoint: an OTLP/HTTP endpoint; without it spans are kept in-process only.
        exporter: an explicit exporter (tests use an in-memory exporter).
        trace_file: append spans as JSON lines to this file (``TORCHRELAY_TRACE_FILE``).
    """
    global _configured_tracing
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if trace_file:
        provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(trace_file)))
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    elif otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint))
            )
        except ImportError:
            logging.getLogger("torchrelay").warning(
                "TORCHRELAY_OTLP_ENDPOINT is set but the OTLP exporter is not installed; "
                "install torchrelay[otlp]"
            )
    if not _configured_tracing:
        trace.set_tracer_provider(provider)
        _configured_tracing = True
    return provider


def tracer(name: str = "torchrelay") -> trace.Tracer:
    """The tracer for torchrelay spans."""
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current W3C trace context (``traceparent``)."""
    carrier: dict[str, str] = dict(headers or {})
    inject(carrier)
    return carrier


def context_from_headers(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context a message's headers carry (an empty context if none)."""
    return extract(dict(headers or {}))


class ServiceMetrics:
    """The Prometheus metrics every service exposes, in the process's own registry."""

    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        self.service = service
        self.messages_total = Counter(
            "torchrelay_messages_total",
            "Messages handled, by subject and outcome",
            ["service", "subject", "outcome"],
            registry=self.registry,
        )
        self.dlq_messages_total = Counter(
            "dlq_messages_total",
            "Messages sent to the dead-letter subject",
            ["service", "reason"],
            registry=self.registry,
        )
        self.handler_seconds = Histogram(
            "torchrelay_handler_seconds",
            "Handler latency",
            ["service", "subject"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
        )
        self.rpc_total = Counter(
            "torchrelay_rpc_total",
            "RPC requests served, by verb and outcome",
            ["service", "verb", "outcome"],
            registry=self.registry,
        )
        # Server side: from the request's arrival to the reply, so a slow handler shows
        # apart from the NATS round trip the caller sees.
        self.rpc_seconds = Histogram(
            "torchrelay_rpc_seconds",
            "RPC handling latency, by verb",
            ["service", "verb"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
        )
