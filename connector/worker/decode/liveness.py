"""Is a prefill that owes us a push round still alive?

In push mode the WRITEs land in our memory and NIXL tells the side they land on nothing
when their writer dies: no handle of ours fails. A load waits for prefill's ``Pushed``
(live) or, failed, is held until it comes (``kvbridge.connector.worker.decode.quarantine``).
So every prefill that owes a round is probed with an empty ``Heartbeat`` each
``PROBE_S``: to a dead one (killed, its connection reset) NIXL reports it disconnected
at once, the outbox drops the peer, and :meth:`Writers.on_drop` ends what waited for it.
A probe that fails for another reason drops nothing: only a confirmed disconnect proves
that no WRITE of the prefill's can still land::

    owes a round --(every PROBE_S)--> Heartbeat([])   ok: alive (or frozen: it buffers)
                                                      disconnected: dropped -> on_drop
    on_drop(agent)  held rounds: ended (nothing more lands from a dead process)
                    live loads it writes: failed by the receiver's next step

A frozen prefill accepts the probes (its kernel still acknowledges TCP): its loads wait
until it resumes or dies, measured in ``scripts/experiments/measure_frozen_peer.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvbridge.connector.common.notifications import Heartbeat
from kvbridge.connector.worker.decode.load_records import Load, LoadState
from kvbridge.connector.worker.decode.quarantine import Quarantine
from kvbridge.connector.worker.peers import Peer, PeerDirectory

PROBE_S = 1.0  # how often a prefill that owes a push round is probed


class Writers:
    """The prefill agents our push loads wait for, and those found gone."""

    def __init__(
        self,
        peers: PeerDirectory,
        send: Callable[[Peer, object], bool],
        quarantine: Quarantine,
    ) -> None:
        self._peers = peers
        self._send = send
        self._quarantine = quarantine
        self.gone: set[str] = set()  # agents removed as dead (a name never comes back)
        self._probed: dict[str, float] = {}  # agent -> last probe
        peers.on_drop.append(self.on_drop)
        # the quarantine's cap: no new load from an agent holding too many of our blocks
        peers.admission.append(quarantine.refusal)

    def on_drop(self, agent: str) -> None:
        """A peer was removed and confirmed dead. Marked only: the drop may come from
        inside one of our sends; the receiver's next step fails the live loads it was
        writing."""
        self.gone.add(agent)
        self._probed.pop(agent, None)
        self._quarantine.peer_gone(agent)

    def writer_gone(self, load: Load) -> bool:
        """A source of ``load`` waits for a push round from a prefill found gone."""
        return any(s.state is LoadState.PUSHED and s.round_agent in self.gone for s in load.sources)

    def probe(self, loads: Iterable[Load], now: float) -> None:
        """Probe every prefill that owes a round (live or held load), each ``PROBE_S``."""
        agents = self._quarantine.awaited_agents | {
            s.round_agent
            for load in loads
            for s in load.sources
            if s.state is LoadState.PUSHED and s.round_agent
        }
        for agent in agents - self.gone:
            if now - self._probed.setdefault(agent, now) < PROBE_S:
                continue  # first seen now, or probed less than PROBE_S ago
            self._probed[agent] = now
            peer = self._peers.with_agent(agent)
            if peer is None:
                if self._peers.gone(agent):  # removed already, by another path
                    self.on_drop(agent)
                # else: removed while not known dead; its rounds stay held (nothing
                # proves its WRITEs stopped), visible in the log and the metrics
            else:
                self._send(peer, Heartbeat(request_ids=[]))  # a disconnect drops it
        for agent in set(self._probed) - agents:
            del self._probed[agent]
