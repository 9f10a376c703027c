"""A KV connector a test drives by hand: the engine's side of a remote prefill without a bus or a prefill worker."""

from __future__ import annotations

from engine.kv_connector import KVConnector, RemoteResult
from engine.sequence import Sequence


class RecordingConnector(KVConnector):
    """An engine's KV connector that records the placements, keeps the sequences named in ``keep`` when they end
    (as a sending one does), and hands over the results and releases a test gives it."""

    def __init__(self, keep: set[str] | None = None) -> None:
        self.keep = keep or set()
        self.placed: dict[str, tuple[int, list[int]]] = {}
        self.results: list[RemoteResult] = []
        self.released: list[str] = []
        self.hold = ""  # the key placement_ended names

    def after_allocation(self, seq: Sequence, blocks: list[int]) -> None:
        self.placed[seq.request_id] = (seq.num_cached, list(blocks))

    def placement_ended(self, seq: Sequence) -> str:
        return self.hold

    def request_finished(self, seq: Sequence) -> bool:
        return seq.request_id in self.keep

    def finished(self) -> tuple[list[RemoteResult], list[str]]:
        results, self.results = self.results, []
        released, self.released = self.released, []
        return results, released
