"""The path and query parameters the routes share, declared once (patterns, bounds, text)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from services.api.models import CURSOR_PATTERN, SPARE_CURSOR_PATTERN

NAME_PATTERN = r"^[A-Za-z0-9_\-.:]{1,128}$"
TOKEN_PATTERN = r"^[A-Za-z0-9_\-]{1,128}$"  # noqa: S105 - a regex
ID_PATTERN = r"^[A-Za-z0-9_\-.:]{1,128}$"
DEFAULT_LIMIT = 50
MAX_LIMIT = 500

Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="page size")]
Cursor = Annotated[
    str | None,
    Query(
        pattern=CURSOR_PATTERN,
        max_length=9,
        description="next_cursor of the previous page: an offset, 1-9 digits",
    ),
]
SpareCursor = Annotated[
    str | None,
    Query(
        pattern=SPARE_CURSOR_PATTERN,
        max_length=256,
        description="next_cursor of the previous page: the last slot_id it listed",
    ),
]
NodeName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=128)]
JobId = Annotated[str, Path(pattern=TOKEN_PATTERN, max_length=128)]
ObjectId = Annotated[str, Path(pattern=ID_PATTERN, max_length=128)]
TokenId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="token_id of the token")]
ClusterQ = Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=128)]
TenantQ = Annotated[str | None, Query(pattern=TOKEN_PATTERN, max_length=128)]
JobIdQ = Annotated[str | None, Query(pattern=TOKEN_PATTERN, max_length=128)]
ObjectIdQ = Annotated[str | None, Query(pattern=ID_PATTERN, max_length=128)]
