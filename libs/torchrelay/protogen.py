"""The contract's part of ``proto/``: a JSON Schema per message and an AsyncAPI 3.0 document.

The ground floor, so it imports nothing above the contract: ``python -m services.protogen``
(which adds the portal API's OpenAPI document) writes and checks the files.
"""

from __future__ import annotations

import json
from typing import Any

from torchrelay import __version__
from torchrelay.contract import (
    CONSUMERS,
    DLQ_STREAM,
    EVENT_SUBJECTS,
    EVENTS_STREAM,
    GENERATIONS_BUCKET,
    MODELS,
    RPC_VERBS,
    SCHEMA_VERSION,
)


def dump(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def json_schemas() -> dict[str, str]:
    """File name → JSON Schema text, one per message model."""
    out = {}
    for name, model in sorted(MODELS.items()):
        schema = model.model_json_schema(mode="validation")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"https://torchrelay.dev/schemas/v{SCHEMA_VERSION}/{name}.json"
        out[f"schemas/{name}.json"] = dump(schema)
    return out


def _channel_id(address: str) -> str:
    return address.replace(".", "_").replace("{", "").replace("}", "").replace(">", "all")


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every subject, stream and RPC verb."""
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for model, address in EVENT_SUBJECTS.items():
        name = model.__name__
        messages[name] = {
            "name": name,
            "payload": {"$ref": f"schemas/{name}.json"},
            "contentType": "application/json",
        }
        cid = _channel_id(address)
        params = {p.split("}")[0]: {"description": p.split("}")[0]} for p in address.split("{")[1:]}
        durable = address.startswith("tr.evt.")
        channel: dict[str, Any] = {
            "address": address,
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
            "description": (
                "JetStream stream " + EVENTS_STREAM.name + "; Nats-Msg-Id = event_id"
                if durable
                else "core NATS"
                if not address.startswith("tr.dlq")
                else "JetStream stream " + DLQ_STREAM.name
            ),
        }
        if params:
            channel["parameters"] = params
        channels[cid] = channel
        operations[f"publish_{cid}"] = {"action": "send", "channel": {"$ref": f"#/channels/{cid}"}}
    for service, verbs in RPC_VERBS.items():
        for verb in verbs:
            cid = f"tr_rpc_{service}_{verb}"
            channels[cid] = {
                "address": f"tr.rpc.{service}.{verb}",
                "description": f"request/reply; reply is RpcReply (queue group rpc-{service})",
                "messages": {"RpcReply": {"$ref": "#/components/messages/RpcReply"}},
            }
            operations[f"request_{cid}"] = {
                "action": "send",
                "channel": {"$ref": f"#/channels/{cid}"},
                "reply": {"channel": {"$ref": f"#/channels/{cid}"}},
            }
    messages["RpcReply"] = {"name": "RpcReply", "payload": {"$ref": "schemas/RpcReply.json"}}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "torchrelay wire contract",
            "version": __version__,
            "description": "Subjects, streams and messages of the torchrelay control plane.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
        "x-torchrelay": {
            "streams": [EVENTS_STREAM.model_dump(), DLQ_STREAM.model_dump()],
            "consumers": [c.model_dump() for c in CONSUMERS.values()],
            "kv_buckets": [
                {
                    "bucket": GENERATIONS_BUCKET,
                    "key": "job_id",
                    "value": "schemas/Generation.json",
                    "writer": "migration_executor (compare-and-set on revision)",
                }
            ],
            "schema_version": SCHEMA_VERSION,
        },
    }


def generate() -> dict[str, str]:
    """Relative path → file content for the contract's part of ``proto/`` (the schemas and
    the AsyncAPI document); :mod:`services.protogen` adds the portal API's OpenAPI document."""
    files = json_schemas()
    files["asyncapi.json"] = dump(asyncapi())
    return files
