"""SeenIds: a bounded set of recent ids. A worker keeps several: redeliveries not to run twice, requests
cancelled before they came, KV writes that landed, prefill attempts that write no more."""

from __future__ import annotations

from collections import OrderedDict


class SeenIds:
    """Ids seen recently (bounded, oldest forgotten first): redeliveries not to run twice, requests
    cancelled before they came, KV writes that landed."""

    def __init__(self, capacity: int = 10_000):
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.capacity = capacity

    def __contains__(self, key: str) -> bool:
        return key in self.ids

    def add(self, key: str) -> bool:
        """True if new."""
        if key in self.ids:
            return False
        self.ids[key] = None
        if len(self.ids) > self.capacity:
            self.ids.popitem(last=False)
        return True

    def discard(self, key: str) -> None:
        self.ids.pop(key, None)
