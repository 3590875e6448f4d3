"""The two shapes most routes have, written once: a page of a list, and one object.

A list route asks a service's list verb, parses the items, drops what the caller may not see
and pages the result (:class:`Listing`); a one-object route asks a get verb, and answers the
same 404 for an object that is missing as for another tenant's (:class:`Lookup`). The auth
check is the routes' dependency (:mod:`services.api.deps`) and the mapping of a service's
errors to problems is the gateway's (:mod:`services.api.gateway`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from services.api.auth import Principal
from services.api.gateway import ApiProblem, Gateway, invalid, items_of, not_found, parse_list

M = TypeVar("M", bound=BaseModel)


# --------------------------------------------------------------------------- pure rules


def page_locally(items: list[Any], limit: int, cursor: str | None) -> tuple[list[Any], str | None]:
    """Paginate a list a service returns whole: the cursor is the offset of the next item."""
    offset = 0
    if cursor is not None:
        if not cursor.isdigit() or len(cursor) > 9:
            raise invalid("cursor", "not a cursor this list returned")
        offset = int(cursor)
    page = items[offset : offset + limit]
    more = offset + limit < len(items)
    return page, (str(offset + limit) if more else None)


def owned(items: list[Any], principal: Principal) -> list[Any]:
    """Drop what the principal may not see (a second check after the service's filter)."""
    if principal.is_operator:
        return items
    return [i for i in items if principal.sees(getattr(i, "tenant", None))]


def tenant_filter(principal: Principal, requested: str | None) -> tuple[str | None, bool]:
    """The tenant to ask the service for, and False when the answer must be empty.

    An operator filters freely; a tenant token is pinned to its tenant, and asking for
    another tenant yields nothing rather than an error that would confirm it exists.
    """
    if principal.is_operator:
        return requested, True
    if requested is not None and requested != principal.tenant:
        return principal.tenant, False
    return principal.tenant, True


# --------------------------------------------------------------------------- lists


class Paging(enum.Enum):
    """Who pages a list: what ``limit`` and ``cursor`` do."""

    SERVICE = "service"
    """Sent to the service, whose ``next_cursor`` is the page's (a bare list is one page)."""
    LOCAL = "local"
    """Not sent: the service answers the whole list and it is paged here by offset."""
    SERVICE_OR_LOCAL = "service-or-local"
    """Sent to the service; a service that answers a bare list is paged here by offset."""


@dataclass(frozen=True, slots=True)
class Listing(Generic[M]):
    """A service's list verb, as the API pages it."""

    model: type[M]
    service: str
    verb: str
    paging: Paging

    async def page(
        self,
        gw: Gateway,
        limit: int,
        cursor: str | None,
        payload: dict[str, Any] | None = None,
        *,
        who: Principal | None = None,
    ) -> tuple[list[M], str | None]:
        """One page: the items (only those ``who`` may see, when given) and the next cursor.

        A service's answer of the wrong shape is a 502 naming it; a cursor this list did not
        hand out is a 422 (paged here) or the service's to refuse.
        """
        query = dict(payload or {})
        if self.paging is not Paging.LOCAL:
            query.update(limit=limit, cursor=cursor)
        data = await gw.call(self.service, self.verb, query)
        raw, nxt = items_of(data, self.service, self.verb)
        items = parse_list(self.model, raw, self.service, self.verb)
        if who is not None:
            items = owned(items, who)
        if self.paging is Paging.LOCAL or (
            self.paging is Paging.SERVICE_OR_LOCAL and isinstance(data, list)
        ):
            items, nxt = page_locally(items, limit, cursor)
        return items, nxt

    async def owned_page(
        self,
        gw: Gateway,
        who: Principal,
        tenant: str | None,
        limit: int,
        cursor: str | None,
        payload: dict[str, Any] | None = None,
    ) -> tuple[list[M], str | None]:
        """:meth:`page` of a tenant-owned list, ``tenant`` the one asked for: a tenant token
        sees only its own (and nothing, rather than an error, when it asks for another)."""
        tenant, visible = tenant_filter(who, tenant)
        if not visible:
            return [], None
        return await self.page(gw, limit, cursor, {**(payload or {}), "tenant": tenant}, who=who)


# --------------------------------------------------------------------------- one object


@dataclass(frozen=True, slots=True)
class Lookup(Generic[M]):
    """A service's get verb of one object, asked as ``{field: id}``; ``kind`` names the
    object in the 404's detail."""

    model: type[M]
    service: str
    verb: str
    kind: str
    field: str

    def missing(self, ident: str) -> ApiProblem:
        """The one 404 of this object, missing or another tenant's."""
        return not_found(self.kind, ident, self.field)

    async def get(self, gw: Gateway, ident: str, who: Principal | None = None) -> M:
        """The object, or the 404 when it does not exist or ``who`` (when given) may not
        see it: both answers are the same, so a tenant cannot probe which ids exist."""
        missing = self.missing(ident)
        found = await gw.fetch(
            self.model, self.service, self.verb, {self.field: ident}, missing=missing
        )
        if who is not None and not who.sees(getattr(found, "tenant", None)):
            raise missing
        return found
