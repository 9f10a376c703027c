"""KVConnector: the engine's one seam to K/V that crosses to another worker (vLLM v1's connector shape).

The engine knows no transport, no bus and no other worker. Receiving (a decode worker): a request added with
``remote=True`` waits in the queue like any other; when the scheduler has placed its prompt (prefix-cache hits
plus fresh blocks) it waits in state ``WAITING_FOR_REMOTE_KV`` and the engine hands its fresh blocks to
`after_allocation` (vLLM's ``update_state_after_alloc``). Once a step, before planning, the engine takes
`finished()` (vLLM's ``get_finished``): prompts whose K/V landed join the batch with the first token the prefill
worker sampled; the others are placed again for another attempt, prefilled here, or dropped. When a placement
ends without landing, `placement_ended` names the key its fresh blocks stay quarantined under, since a late
write may still hit them, until `finished()` releases that key.

Sending (a prefill worker): in the step that completes a prompt, `save_layer` (vLLM's ``save_kv_layer``) runs after
each layer, while the next one computes; a sequence that ends is kept with its blocks while `request_finished`
says so (vLLM's delayed free), until `finished()` releases its request id.

Every method runs on the model thread; an implementation that works on an event loop hands its results over
through `finished()` and wakes the model thread itself (actors.remote_prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling import TokenLogprob
    from engine.sequence import Sequence

LANDED, RETRY, LOCAL, DROP = "landed", "retry", "local", "drop"


@dataclass
class RemoteResult:
    """How a placed prompt's remote K/V ended: ``landed`` (join the batch with ``first_token``), ``retry`` (place it
    again: another attempt), ``local`` (prefill it here) or ``drop`` (the request failed; its owner says why)."""

    request_id: str
    outcome: str
    first_token: int = 0
    info: TokenLogprob | None = None


class KVConnector:
    """No K/V crosses: every prompt is computed here and nothing is sent (an aggregated worker, `tandem generate`)."""

    #: `save_layer` is called (False: the model runs without a per-layer call)
    saves_layers = False

    def after_allocation(self, seq: Sequence, blocks: list[int]) -> None:
        """`seq`'s prompt is placed: another worker may write its K/V from token ``seq.num_cached`` on into
        `blocks` (in `Scheduler.prompt_blocks` order)."""
        raise RuntimeError(f"request {seq.request_id} waits for remote K/V, and this engine has no connector")

    def placement_ended(self, seq: Sequence) -> str:
        """`seq`'s placement ends without its K/V (a retry, a local prefill, a drop, an abort): the key to quarantine
        its fresh blocks under until `finished()` releases it, or '' to free them now."""
        return ""

    def save_layer(self, layer: int, seqs: list[Sequence]) -> None:
        """`layer`'s K/V of `seqs`, whose prompts this step completes, is in the pool (only with `saves_layers`)."""

    def request_finished(self, seq: Sequence) -> bool:
        """`seq` has ended: True keeps it and its blocks (its K/V is still being sent) until `finished()` releases
        its request id."""
        return False

    def finished(self) -> tuple[list[RemoteResult], list[str]]:
        """The remote prefills that ended since the last call, and the keys the engine may free now: quarantines
        (`placement_ended`) and kept sequences (`request_finished`)."""
        return [], []
