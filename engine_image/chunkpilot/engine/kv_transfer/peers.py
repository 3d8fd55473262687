"""The decode side's view of the prefill pods: their addresses (host:port entries; a name that resolves to several
addresses, a headless Service, is every pod behind it), each one's load as it last reported it, and the choice
among them: power of two choices on `num_waiting` (Mitzenmacher), skipping pods that are saturated or did not
answer the last poll, as llm-d's and Dynamo's routers pick prefill workers."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import Collection
from dataclasses import dataclass

import httpx

from chunkpilot.engine.kv_transfer.wire import PeerLoad

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # how stale a peer's load may be; a prefill pod's queue changes on the scale of its steps


@dataclass(frozen=True)
class Peer:
    url: str  # http://host:port
    load: PeerLoad


def parse_peers(spec: str) -> list[tuple[str, int]]:
    """`--prefill-peers`: host:port entries separated by commas. Raises ValueError naming the bad entry."""
    out = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"prefill peer {entry!r} is not host:port (e.g. llama-prefill.default.svc:8000)")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("--prefill-peers names no host:port")
    return out


def choose(peers: list[Peer], max_waiting: int, rng: random.Random,
           exclude: Collection[str] = ()) -> Peer | None:
    """Two peers at random among those not saturated, the less loaded of the two; None when every one is.
    `exclude`: urls left out (those that already failed the request a retry is for)."""
    open_ = [p for p in peers if p.load.num_waiting <= max_waiting and p.url not in exclude]
    if not open_:
        return None
    if len(open_) == 1:
        return open_[0]
    a, b = rng.sample(open_, 2)
    return a if (a.load.num_waiting, a.load.num_running) <= (b.load.num_waiting, b.load.num_running) else b


class PrefillPeers:
    """Polls every prefill pod's GET /kv/load in the background (started from the event loop)."""

    def __init__(self, spec: str, client: httpx.AsyncClient, *, fingerprint: str, max_waiting: int,
                 headers: dict[str, str] | None = None, rng: random.Random | None = None,
                 on_refresh=None) -> None:
        """`on_refresh(n)`: told how many peers answered each poll (a gauge)."""
        self.entries = parse_peers(spec)
        self.client = client
        self.fingerprint = fingerprint
        self.max_waiting = max_waiting
        self.headers = headers or {}
        self.rng = rng or random.Random()
        self.peers: list[Peer] = []
        self._task: asyncio.Task | None = None
        self.on_refresh = on_refresh

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def pick(self, exclude: Collection[str] = ()) -> Peer | None:
        return choose(self.peers, self.max_waiting, self.rng, exclude)

    def mark_down(self, url: str) -> None:
        """A call to this peer failed: leave it out until its next answer to a poll."""
        self.peers = [p for p in self.peers if p.url != url]

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a poll must never end the loop
                log.exception("polling the prefill pods failed")
            await asyncio.sleep(POLL_SECONDS)

    async def refresh(self) -> None:
        urls = await asyncio.get_running_loop().run_in_executor(None, self._resolve)
        answers = await asyncio.gather(*(self._load(u) for u in urls))
        self.peers = [Peer(u, load) for u, load in zip(urls, answers) if load is not None]
        if self.on_refresh is not None:
            self.on_refresh(len(self.peers))

    def _resolve(self) -> list[str]:
        urls = []
        for host, port in self.entries:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                continue  # not resolvable now (no prefill pod ready yet): next poll
            for addr in sorted({info[4][0] for info in infos}):
                urls.append(f"http://[{addr}]:{port}" if ":" in addr else f"http://{addr}:{port}")
        return urls

    async def _load(self, url: str) -> PeerLoad | None:
        try:
            r = await self.client.get(url + "/kv/load", headers=self.headers, timeout=1.0)
            if r.status_code != 200:
                return None
            load = PeerLoad.model_validate_json(r.content)
        except (httpx.HTTPError, ValueError):
            return None
        if load.fingerprint != self.fingerprint:
            log.warning("prefill pod %s has another KV layout (model, dtype or block size): not used", url)
            return None
        return load
