"""What the operator and the tuner do alike as kopf processes: settings with their own annotation prefix and
peering (two kopf processes on one resource must not share bookkeeping), the kubernetes client's login, and
running kopf in a thread of its own so that our signal handler sees SIGTERM first."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import dataclass

import kopf


@dataclass(frozen=True)
class KopfProcess:
    prefix: str  # annotation prefix for kopf's progress, diff-base and finalizer
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    peering: str | None = None  # None: standalone
    # kopf peering pauses every replica that sees a peer of higher priority, and pauses all of them, itself too, when
    # peers share a priority (kopf 1.45, peering.process_peering_event). Replicas of one Deployment share their arguments, so None draws a random priority per
    # process: one of them acts, the others stand by until its peering record expires.
    priority: int | None = None
    liveness: str | None = None
    # kopf's finalizer name; kopf patches a resource to remove it when no handler needs it. None: <prefix>/finalizer
    finalizer: str | None = None
    workers: int = 16  # executor threads for sync handlers and daemons

    def __post_init__(self) -> None:
        if self.priority is None:
            object.__setattr__(self, "priority", random.SystemRandom().randint(1, 2**31 - 1) if self.peering else 0)

    def settings(self) -> kopf.OperatorSettings:
        s = kopf.OperatorSettings()
        s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=self.prefix)
        s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=self.prefix,
                                                                          key="last-handled-configuration")
        s.persistence.finalizer = self.finalizer or f"{self.prefix}/finalizer"
        s.execution.max_workers = self.workers
        # kopf retries a failed API request 8 times over 54 s, then gives the error up; after a longer outage
        # its watches then waited on their own backoff, and a change made right after the API server was back
        # went unseen for up to a minute. Retried without end instead, at most 5 s apart: each watch reconnects
        # within seconds of the API server's return.
        s.networking.error_backoffs = ReconnectBackoffs()
        # Only our explicit Events reach `kubectl describe`, not kopf's per-handler chatter.
        s.posting.level = logging.WARNING
        s.peering.standalone = self.peering is None
        if self.peering:
            s.peering.name = self.peering
            s.peering.priority = self.priority
            s.peering.clusterwide = not self.namespaces
        return s

    def run(self, registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings, memo: kopf.Memo,
            stop: threading.Event) -> None:
        """Blocks until `stop` is set (by the caller's signal handler) and kopf has finished."""
        failure: list[BaseException] = []

        def operate() -> None:
            try:
                asyncio.run(kopf.operator(
                    registry=registry, settings=settings, clusterwide=not self.namespaces,
                    namespaces=list(self.namespaces), standalone=self.peering is None, peering_name=self.peering,
                    priority=self.priority, liveness_endpoint=self.liveness, memo=memo, stop_flag=stop))
            except BaseException as e:  # noqa: BLE001 - reported by the calling thread
                failure.append(e)

        thread = threading.Thread(target=operate, name="kopf", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
        if failure:
            raise SystemExit(f"{self.prefix} stopped: {failure[0]!r}")


class ReconnectBackoffs:
    """1, 1, 2, 3 seconds, then 5 for ever; a fresh sequence for each request (kopf iterates it per request, so
    one shared iterator would run dry)."""

    def __iter__(self):
        yield from (1, 1, 2, 3)
        while True:
            yield 5


def with_client_login(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    """A registry of our own starts without kopf's default login; use the kubernetes client's (in-cluster
    service account, else kubeconfig), the same credentials our own API calls use."""

    @kopf.on.login(registry=registry)
    def login(**kwargs) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    return registry
