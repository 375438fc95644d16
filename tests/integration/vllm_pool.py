"""vLLM API servers shared between the test modules of one pytest session, by configuration.

Starting a vLLM server costs a minute or more on a 2-core machine (three processes that
each import vLLM and torch). A module asks the session's pool for its servers
(:meth:`ServerPool.serving`); a server handed back by the module before it whose
configuration (:func:`configuration`: every :class:`ServerSpec` field but the name) equals
one asked for is that server again, the others start together as they always did::

    test_vllm_cold_start (pull)   prefill 64, decode 32, reference 32   started cold
    test_vllm_router              the same three configurations          taken over

What a module hands back waits for the next module only: the pool stops every idle server
the next module's first request does not take, and the test hooks
(``tests/integration/conftest.py``) stop them all when the next module does not use the
pool, so a server never idles through other tests; the session's end stops the rest.
Names stay the module's own (``servers["ref"]``), the server keeps the name (and engine
id, log file) it started with. A module whose tests damage its servers (kill or freeze
them) or need them fresh says so: ``share=False`` or ``fresh=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from kvbridge.examples.vllm.procs import Service, start_all, stop_all
from kvbridge.examples.vllm.servers import ServerSpec, vllm_service

START_TIMEOUT_S = 900.0


class _Located(Protocol):
    @property
    def path(self) -> Path: ...


T = TypeVar("T", bound=_Located)


def run_after(items: Sequence[T], leaders: Mapping[Path, Path]) -> list[T]:
    """``items`` (pytest's, in run order) with the items of each module ``f`` of
    ``leaders`` moved right after those of module ``leaders[f]``, so that ``f`` takes over
    what ``leaders[f]`` hands back; the order inside each module is kept, and a module
    whose leader is not in the run stays where it was."""
    by_module: dict[Path, list[T]] = {}
    for item in items:
        by_module.setdefault(item.path, []).append(item)
    modules = list(by_module)
    for follower, leader in leaders.items():
        if follower in by_module and leader in by_module:
            modules.remove(follower)
            modules.insert(modules.index(leader) + 1, follower)
    return [item for module in modules for item in by_module[module]]


def configuration(spec: ServerSpec) -> str:
    """What decides a server's behaviour, as a key: every field of ``spec`` but its name
    (the engine id vLLM logs and kvbridge advertises) and its index (the engine id's
    default). The core a server is pinned to by its place in a module's list
    (``slot``) is left out too: placement, not configuration."""
    fields = dataclasses.asdict(spec)
    del fields["name"], fields["index"]
    return json.dumps(fields, sort_keys=True, default=str)


@dataclasses.dataclass
class _Idle:
    service: Service
    key: str


class ServerPool:
    """The session's vLLM servers: in use by a module, or idle until the next module."""

    def __init__(self) -> None:
        self._idle: list[_Idle] = []
        self._in_use: set[Service] = set()
        self.reused: list[str] = []  # "module name <- server name", for the report
        self.started = 0

    @contextlib.contextmanager
    def serving(
        self,
        specs: list[ServerSpec],
        logs: Path,
        *,
        fresh: bool = False,
        share: bool = True,
        timeout_s: float = START_TIMEOUT_S,
        first_slot: int = 0,
    ) -> Iterator[dict[str, Service]]:
        """The servers of ``specs`` by their names here; server ``i`` started anew is
        pinned as ``vllm_service(specs[i], logs, slot=first_slot + i)`` pins it.

        ``fresh``: none taken from the idle ones (a test that times a server's first
        request). ``share=False``: stopped on exit instead of handed back (tests that kill
        or freeze a server). Idle servers that none of ``specs`` takes are stopped before
        the new ones start. A start that fails stops what it started and raises
        :class:`~kvbridge.examples.vllm.procs.ServiceError`."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique in one request, got {names}")
        taken: dict[str, Service] = {}
        if not fresh:
            for spec in specs:
                key = configuration(spec)
                match = next((i for i in self._idle if i.key == key and i.service.alive()), None)
                if match is not None:
                    self._idle.remove(match)
                    taken[spec.name] = match.service
                    self.reused.append(f"{spec.name} <- {match.service.name}")
        self.stop_idle()
        new = {
            s.name: vllm_service(s, logs, slot=first_slot + i)
            for i, s in enumerate(specs)
            if s.name not in taken
        }
        services = {**taken, **new}
        self._in_use.update(services.values())
        keys = {s.name: configuration(s) for s in specs}
        handed_back = False
        try:
            start_all(list(new.values()), timeout_s=timeout_s)
            self.started += len(new)
            yield {name: services[name] for name in names}
            handed_back = share
        finally:
            self._in_use.difference_update(services.values())
            for name, service in services.items():
                if handed_back and service.alive():
                    self._idle.append(_Idle(service, keys[name]))
                else:
                    stop_all([service])

    @property
    def idle(self) -> list[str]:
        return [i.service.name for i in self._idle]

    def stop_idle(self) -> None:
        """Stop every idle server (the next module takes none of them)."""
        idle, self._idle = self._idle, []
        stop_all([i.service for i in idle])

    def close(self) -> None:
        """Stop every server, idle or in use (the session's end)."""
        self.stop_idle()
        in_use, self._in_use = list(self._in_use), set()
        stop_all(in_use)
