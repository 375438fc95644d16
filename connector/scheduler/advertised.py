"""The side-channel ports a prefill's ``kv_transfer_params`` advertise.

The scheduler speaks for every worker rank of its engine, but only the workers bind::

    kv_port 5600, TP 2   ranks bind 5600, 5601      params: remote_port 5600 (rank 0);
                                                    decode finds rank r at 5600 + r
    kv_port 0,    TP 2   ranks bind ephemeral       params: remote_port = rank 0's port,
                         ports, e.g. 41233, 38111   remote_ports [41233, 38111]

With ``kv_port`` 0 the ports exist only once every rank's listener is bound, so the engine
hands them over (:meth:`AdvertisedPorts.bind`: kvbridge's example engine from its worker
in the same process, the vLLM adapter from vLLM's handshake metadata of every rank) before
the first request finishes; until then :meth:`AdvertisedPorts.advertise` refuses to hand
out params (:class:`PortsNotBoundError`): params naming a port nobody listens on would
make decode wait for a handshake that cannot be answered.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.connector.common.config import ConfigError


class PortsNotBoundError(ConfigError):
    """``kv_port`` 0 and the workers' bound side-channel ports were not handed over."""


class AdvertisedPorts:
    """The side-channel port of every rank ``0..tp_size-1`` of one engine."""

    def __init__(self, kv_port: int, tp_size: int) -> None:
        self.kv_port = kv_port
        self.tp_size = tp_size
        fixed = tuple(kv_port + r for r in range(tp_size)) if kv_port else None
        self._ports: tuple[int, ...] | None = fixed

    @property
    def ports(self) -> tuple[int, ...] | None:
        """Every rank's port, rank order; None while kv_port 0 waits for :meth:`bind`."""
        return self._ports

    def bind(self, ports: Sequence[int]) -> None:
        """The ports the workers' listeners bound, rank order (raises ConfigError when
        they are not one port per rank, or contradict a fixed ``kv_port``)."""
        got = tuple(int(p) for p in ports)
        if len(got) != self.tp_size or any(not 0 < p < 65536 for p in got):
            raise ConfigError(
                f"side-channel ports {list(got)}: expected one bound port (1..65535) for "
                f"each of the {self.tp_size} ranks"
            )
        if self.kv_port and got != self._ports:
            raise ConfigError(
                f"the workers bound side-channel ports {list(got)}, but kv_port="
                f"{self.kv_port} says {list(self._ports or ())}; the scheduler and its "
                f"workers must share one kv-transfer config"
            )
        self._ports = got

    def advertise(self, request_id: str) -> tuple[int, list[int]]:
        """``(remote_port, remote_ports)`` for a request's params: rank 0's port, and the
        list of every rank's (empty for a fixed ``kv_port``: decode adds the rank)."""
        if self._ports is None:
            raise PortsNotBoundError(
                f"request {request_id!r}: kv_port is 0 (ephemeral side-channel ports) and "
                f"the workers' bound ports have not reached the scheduler yet; hand them "
                f"over with KVBridgeScheduler.set_side_channel_ports(ports) before serving "
                f"remote-decode requests (no params are handed out meanwhile)"
            )
        return self._ports[0], [] if self.kv_port else list(self._ports)
