"""The static source of the ready set: a fixed list of replica URLs (`--replicas`)."""

from __future__ import annotations

import time

from proxy.errors import ConfigError
from proxy.readyset import ReadySet
from proxy.wire.errors import SnapshotInvalid
from proxy.wire.policies import DEFAULT_POLICY
from proxy.wire.snapshot import ReadyReplica, ReadySnapshot


class StaticSource:
    """A fixed list of replica URLs, given on the command line (`--replicas`)."""

    def __init__(self, urls: tuple[str, ...], policy: str = DEFAULT_POLICY) -> None:
        self._urls = urls
        self._policy = policy

    async def start(self, ready_set: ReadySet) -> None:
        try:
            self._apply(ready_set)
        except (SnapshotInvalid, ValueError) as exc:  # ValueError: the Struct's own checks
            raise ConfigError(f"--replicas: {exc}") from exc

    def _apply(self, ready_set: ReadySet) -> None:
        ready_set.apply(
            ReadySnapshot(
                service="static",
                generation=1,
                published_at=time.time(),
                policy=self._policy,
                active_versions=[1],
                replicas=tuple(
                    ReadyReplica(id=i + 1, url=url.rstrip("/")) for i, url in enumerate(self._urls)
                ),
            )
        )

    async def aclose(self) -> None:
        return None
