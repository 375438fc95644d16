"""A kept request's hold on prefill: who may read its blocks, and until when.

One clock decides when a hold ends: this one. The scheduler frees kept blocks only when
this sender reports the request finished (``finished_sending``), never on a clock of its
own. A claim (``Prepare``) belongs to its reader, the (decode agent, rank) that sent it:
it extends the hold to at least ``max(lease_s, hold_s)`` from now and answers how long it
lasts (``Prepared.held_s``). The hold then ends no sooner for *any* reason (the readers'
``Done``, an engine abort) unless that reader's own ``Done`` names the claim: the same
params may reach two decodes (a router retrying or hedging, a client replaying them), and
the first one's ``Done`` must not free blocks the second was promised. A push writing from
the blocks *pins* them (``Sender.pin``): the hold does not end, whatever ends it,
until the push's WRITEs ended::

    kept --(Done from the last reader | lease ran out | abort)--> ending: no new reader
         is granted a claim; wait for every granted claim (its reader's Done, or its time
         ran out) and the pushes' WRITEs --> restored, reported finished

The readers a hold waits for are counted by their ``Done`` (``Done.readers``: decode ranks
that each read some of this rank's heads), one per (agent, rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.layouts.arrangement import BlockArrangement

Reader = tuple[str, int]  # (decode's NIXL agent, its rank): who claims and says Done
# readers one request may have (decode ranks, times the decodes the same params reach):
# a peer naming more, one rank number after another, is refused rather than remembered
MAX_READERS = 256


@dataclass
class Claim:
    """What one reader was granted: the hold lasts for it until ``until`` unless its own
    ``Done`` names one of ``numbers`` first."""

    numbers: set[int]
    until: float
    ended: bool = False  # its reader's Done named it


@dataclass
class Kept:
    """A request whose blocks are kept here for their readers, and the hold on them."""

    spec: SendSpec
    deadline: float
    rewritten: dict[int, tuple[BlockArrangement, BlockArrangement]] = field(default_factory=dict)
    done_by: set[Reader] = field(default_factory=set)  # readers that said Done
    readers: int = 1  # readers the hold waits for (the last Done's ``readers``)
    eager: bool = False  # rewritten on add, in the last reader's format; no reader asked yet
    claims: dict[Reader, Claim] = field(default_factory=dict)  # granted, by reader
    pins: int = 0  # pushes whose WRITEs may still read the blocks
    native: set[int] = field(default_factory=set)  # groups a reader claimed as they are
    ending: str = ""  # why the hold ends, once it may not end yet (pinned, claimed)
    # the latest a claim may extend the hold to (its lease and the longest claim, from
    # when it was kept): a decode that claims again and again, or a peer that loops, cannot
    # pin the blocks for longer, in total. Heartbeats (a decode's queue) extend by the
    # lease, the holder's own figure, while the hold is not ending
    limit: float = float("inf")

    def claimed_until(self, now: float) -> float:
        """When the last granted claim still running runs out (0.0: none runs)."""
        live = [c.until for c in self.claims.values() if not c.ended and c.until > now]
        return max(live, default=0.0)

    def extends(self, reader: Reader, now: float) -> bool:
        """``reader`` holds a claim that still runs: it may extend it while the hold is
        ending (its READs outlast half the hold); a reader without one may not start."""
        claim = self.claims.get(reader)
        return claim is not None and not claim.ended and claim.until > now
