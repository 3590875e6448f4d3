"""The guarantee of each term in progress as Prometheus gauges, for the operators' dashboards.

The ledger stays the source of truth (``guarantee`` answers from it); these gauges only show
it. A contract whose term has not begun is tracked and shown once it begins; one whose term
has ended is dropped (its final figure is the term's close, in the ledger).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from torchrelay.contract import Contract, Guarantee

from .ledger import Ledger
from .rules import covers

#: How often the service re-reads the tracked contracts' guarantees (terms begin and end
#: without an event; incidents refresh their own contract at once).
GUARANTEE_GAUGE_INTERVAL_S = 30.0
_PAGE = 500


class GuaranteeGauges:
    """``torchrelay_guarantee_*{contract_id, tenant}`` of the terms in progress."""

    def __init__(self, ledger: Ledger, registry: CollectorRegistry) -> None:
        self._ledger = ledger
        self.ratio = Gauge(
            "torchrelay_guarantee_ratio",
            "Failures resolved by live migration / eligible failures of the term so far "
            "(1 with none)",
            ["contract_id", "tenant"],
            registry=registry,
        )
        self.threshold = Gauge(
            "torchrelay_guarantee_threshold",
            "The ratio the contract guarantees for its term",
            ["contract_id", "tenant"],
            registry=registry,
        )
        self.eligible = Gauge(
            "torchrelay_guarantee_eligible_failures",
            "Eligible failures of the term so far",
            ["contract_id", "tenant"],
            registry=registry,
        )
        self.resolved = Gauge(
            "torchrelay_guarantee_resolved_failures",
            "Eligible failures of the term so far resolved by live migration",
            ["contract_id", "tenant"],
            registry=registry,
        )
        self._tracked: dict[str, Contract] = {}
        self._shown: set[str] = set()

    async def load(self) -> None:
        """Track every contract whose term has not ended (once, at the service's start)."""
        now = self._ledger.clock()
        cursor: str | None = None
        while True:
            items, cursor = await self._ledger.list_contracts(limit=_PAGE, cursor=cursor)
            for contract in items:
                if contract.term_end > now:
                    self._tracked[contract.contract_id] = contract
            if cursor is None:
                return

    def track(self, contract: Contract) -> None:
        """Track a contract created after :meth:`load`."""
        if contract.term_end > self._ledger.clock():
            self._tracked[contract.contract_id] = contract

    async def refresh(self, contract_id: str | None = None) -> None:
        """Show the guarantee of the tracked terms in progress (of one contract if given)
        and drop the terms that have ended."""
        now = self._ledger.clock()
        ids = [contract_id] if contract_id is not None else list(self._tracked)
        for cid in ids:
            contract = self._tracked.get(cid)
            if contract is None:
                continue  # an uncovered tenant's chain, or a term that ended
            if covers(contract, now):
                self._show(contract, await self._ledger.guarantee(cid))
            elif contract.term_end <= now:
                self._drop(contract)

    def _show(self, contract: Contract, guarantee: Guarantee) -> None:
        if contract.contract_id not in self._tracked:
            return  # dropped by a concurrent refresh while the ledger was read
        labels = (contract.contract_id, contract.tenant)
        self.ratio.labels(*labels).set(guarantee.ratio)
        self.threshold.labels(*labels).set(guarantee.threshold)
        self.eligible.labels(*labels).set(guarantee.eligible_failures)
        self.resolved.labels(*labels).set(guarantee.resolved_by_migration)
        self._shown.add(contract.contract_id)

    def _drop(self, contract: Contract) -> None:
        self._tracked.pop(contract.contract_id, None)
        if contract.contract_id in self._shown:
            self._shown.discard(contract.contract_id)
            for gauge in (self.ratio, self.threshold, self.eligible, self.resolved):
                gauge.remove(contract.contract_id, contract.tenant)
