"""The adapter between the SkyPilot backend and SkyPilot's client SDK.

`SkyPilotSdk` is the small Protocol the backend (`controlplane.backends.skypilot`)
talks to; `SkyPilotClient` implements it with the client/server SDK of SkyPilot
0.14 (`sky.launch`, `sky.down`, `sky.status`, `sky.endpoints` return request ids;
`sky.get` waits for one; `sky.api_cancel` cancels one; `sky.tail_logs` streams a
job log). Tests implement the Protocol with a fake (tests/support/skypilot_fake.py);
`SDK_CALLS` lists every SDK function and keyword used here, and a contract test
checks them against the installed SkyPilot's real signatures.

The SDK is blocking (HTTP to the SkyPilot API server), so every call runs on a
small thread pool this object owns; nothing blocks the event loop. SkyPilot is
an optional dependency (`pip install 'sluice[skypilot]'`), imported on first
use; when it is missing, `load_sky()` raises `SkyPilotMissing` with the one
line that says what to install.

Errors are translated here and nowhere else, into `SdkError` (with `retryable`
set for SkyPilot's "no capacity" and transient API-server errors) and
`ClusterGone` (`down` treats it as done).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TextIO, TypeVar

from controlplane.backends.base import BackendError

T = TypeVar("T")

INSTALL_HINT = "pip install 'sluice[skypilot]'"

#: Every SDK function the client calls, with the keywords it passes (checked against
#: the installed SkyPilot by tests/controlplane/test_skypilot_contract.py).
SDK_CALLS: dict[str, tuple[str, ...]] = {
    "launch": (
        "task",
        "cluster_name",
        "retry_until_up",
        "idle_minutes_to_autostop",
        "down",
        "_need_confirmation",
    ),
    "down": ("cluster_name", "purge"),
    "status": ("cluster_names", "refresh", "all_users"),
    "endpoints": ("cluster", "port"),
    "get": ("request_id",),
    "api_cancel": ("request_ids", "silent"),
    "tail_logs": ("cluster_name", "job_id", "follow", "tail", "output_stream"),
    "Task.from_yaml_config": ("config",),
}
#: The fields of a `sky.status` record and the attributes of a cluster's launched
#: resources that `_cluster_info` reads (checked by the same contract test).
STATUS_FIELDS = ("name", "status", "handle", "cloud", "region", "accelerators", "resources_str")
RESOURCES_ATTRS = ("cloud", "region", "zone", "instance_type", "use_spot", "get_cost")


class SkyPilotMissing(BackendError):
    """SkyPilot is not installed where sluice runs."""


class SdkError(BackendError):
    """A SkyPilot call failed; the message is SkyPilot's own error text.

    `retryable`: SkyPilot found no capacity (after its own failover) or the API
    server was briefly unavailable; trying again later may succeed.
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ClusterGone(SdkError):
    """The cluster does not exist (any more)."""


#: SkyPilot's cluster states (sky.utils.status_lib.ClusterStatus values).
UP = "UP"
INIT = "INIT"
STOPPED = "STOPPED"


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """One cluster as `sky.status` reports it, reduced to what sluice shows and decides on."""

    name: str
    status: str  # UP, INIT, STOPPED, AUTOSTOPPING, PENDING
    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    accelerators: str | None = None  # e.g. "L4:1"
    spot: bool | None = None
    hourly_price: float | None = None  # USD per hour, when SkyPilot knows it
    resources: str | None = None  # SkyPilot's own summary, e.g. "1x(gpus=L4:1, g6.xlarge)"


class SkyPilotSdk(Protocol):
    """What the SkyPilot backend needs from SkyPilot; see the module docstring."""

    async def launch(self, task: Mapping[str, Any], cluster_name: str) -> str:
        """Submit a launch of `task` (a SkyPilot task YAML as a mapping); its request id."""

    async def wait(self, request_id: str) -> None:
        """Wait for a launch request to finish; raise SdkError with SkyPilot's reason."""

    async def cancel(self, request_id: str) -> None:
        """Cancel a request (best effort)."""

    async def status(
        self, cluster_names: Sequence[str] | None = None, *, refresh: bool = False
    ) -> list[ClusterInfo]:
        """The clusters named (all of this user's when None); `refresh` asks the clouds."""

    async def endpoints(self, cluster_name: str) -> dict[int, str]:
        """The cluster's exposed ports and where each is reached (`host:port` or a URL)."""

    async def down(self, cluster_name: str, *, wait: bool = True) -> None:
        """Tear the cluster down; `wait=False` returns once SkyPilot accepted the request.
        Raises ClusterGone when there is no such cluster."""

    async def tail_logs(self, cluster_name: str, *, follow: bool, out: TextIO) -> int:
        """Copy the cluster's latest job log to `out`; the job's exit code."""

    async def aclose(self) -> None:
        """Release the thread pool."""


def load_sky() -> ModuleType:
    """`import sky`, or SkyPilotMissing with the install hint."""
    try:
        return importlib.import_module("sky")
    except ImportError as exc:
        raise SkyPilotMissing(
            f"the skypilot backend needs SkyPilot, which is not installed here ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc


class SkyPilotClient:
    """`SkyPilotSdk` on SkyPilot's client SDK (the API server it is configured for)."""

    def __init__(self, *, threads: int = 8) -> None:
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._sky: ModuleType | None = None

    def _module(self) -> ModuleType:
        if self._sky is None:
            self._sky = load_sky()
        return self._sky

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._threads, thread_name_prefix="sluice-skypilot"
            )
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        except BackendError:
            raise
        except Exception as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: Exception) -> SdkError:
        sky = self._module()
        errors = sky.exceptions
        text = str(exc) or type(exc).__name__
        if isinstance(exc, errors.ClusterDoesNotExist):
            return ClusterGone(text)
        retryable = (errors.ResourcesUnavailableError, errors.ServerTemporarilyUnavailableError,
                     ConnectionError, TimeoutError)  # fmt: skip
        return SdkError(text, retryable=isinstance(exc, retryable))

    async def launch(self, task: Mapping[str, Any], cluster_name: str) -> str:
        sky = self._module()

        def submit() -> str:
            built = sky.Task.from_yaml_config(dict(task))
            request_id = sky.launch(
                built, cluster_name=cluster_name, retry_until_up=False,
                idle_minutes_to_autostop=None, down=False, _need_confirmation=False,
            )  # fmt: skip
            return str(request_id)

        return await self._call(submit)

    async def wait(self, request_id: str) -> None:
        await self._call(self._module().get, request_id)

    async def cancel(self, request_id: str) -> None:
        sky = self._module()
        await self._call(lambda: sky.get(sky.api_cancel(request_ids=[request_id], silent=True)))

    async def status(
        self, cluster_names: Sequence[str] | None = None, *, refresh: bool = False
    ) -> list[ClusterInfo]:
        sky = self._module()
        mode = sky.StatusRefreshMode.FORCE if refresh else sky.StatusRefreshMode.NONE
        names = list(cluster_names) if cluster_names is not None else None
        records = await self._call(
            lambda: sky.get(sky.status(cluster_names=names, refresh=mode, all_users=False))
        )
        return [_cluster_info(record) for record in records]

    async def endpoints(self, cluster_name: str) -> dict[int, str]:
        sky = self._module()
        found = await self._call(lambda: sky.get(sky.endpoints(cluster=cluster_name, port=None)))
        return {int(port): str(url) for port, url in dict(found).items()}

    async def down(self, cluster_name: str, *, wait: bool = True) -> None:
        sky = self._module()

        def run() -> None:
            request_id = sky.down(cluster_name=cluster_name, purge=False)
            if wait:
                sky.get(request_id)

        await self._call(run)

    async def tail_logs(self, cluster_name: str, *, follow: bool, out: TextIO) -> int:
        sky = self._module()
        stream = out if isinstance(out, io.TextIOBase) else None
        code = await self._call(
            sky.tail_logs, cluster_name=cluster_name, job_id=None, follow=follow, tail=0,
            output_stream=stream,
        )  # fmt: skip
        return int(code) if isinstance(code, int) else 0

    async def aclose(self) -> None:
        if self._pool is not None:
            # A blocked sky.get cannot be interrupted; its thread ends with the request.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _cluster_info(record: Any) -> ClusterInfo:
    """A `sky.status` record (StatusResponse, or a dict from older servers) as ClusterInfo."""

    def field(name: str) -> Any:
        if isinstance(record, Mapping):
            return record.get(name)
        return getattr(record, name, None)

    status = field("status")
    status = getattr(status, "value", status)
    launched = getattr(field("handle"), "launched_resources", None)
    zone = getattr(launched, "zone", None)
    instance_type = getattr(launched, "instance_type", None)
    spot = getattr(launched, "use_spot", None)
    price: float | None = None
    if launched is not None:
        try:
            price = float(launched.get_cost(3600))
        except Exception:  # the catalog may be unreachable from here: price unknown
            price = None
    launched_cloud = getattr(launched, "cloud", None)
    cloud = field("cloud") or (str(launched_cloud) if launched_cloud is not None else None)
    return ClusterInfo(
        name=str(field("name")),
        status=str(status),
        cloud=cloud,
        region=field("region") or getattr(launched, "region", None),
        zone=zone,
        instance_type=instance_type,
        accelerators=field("accelerators"),
        spot=bool(spot) if spot is not None else None,
        hourly_price=price,
        resources=field("resources_str"),
    )
