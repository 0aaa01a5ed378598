"""Where a `--redis URL` becomes a redis-py client: the one place both the proxy and
the control plane (store, controller, CLI) build their Redis clients.

Accepted forms:

    redis://[[user]:password@]host:port[/db]          one Redis (redis-py's own parser)
    rediss://...                                      the same over TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=N]
    redis+sentinel://[[user]:password@]host:port[,host:port...]/service-name[/db]
                     [?sentinel_password=...&sentinel_username=...]
    rediss+sentinel://...                             the same, TLS to the sentinels and
                                                      to the data nodes

In the Sentinel form the hosts are the sentinels (at least one; list all of them),
`service-name` is the name the sentinels monitor (`sentinel monitor NAME ...`) and
`db` defaults to 0. The password in the user-info part is the one of the data nodes
(the primary and its replicas, `requirepass`); sentinels are contacted without a
password unless `sentinel_password` is given (their own `requirepass`): the data
password never goes to a sentinel. Whoever answers as a sentinel still picks the
primary the data password is sent to, so sentinels are inside the trust boundary;
`rediss+sentinel://` verifies the certificate of every sentinel and of the primary
it names (against `--redis-ca-file` or the system's CAs), so neither can be
impersonated on the network. Every
client asks the sentinels for the current primary whenever it opens a connection,
so after a failover a reconnect lands on the new primary; connections to a primary
that was demoted are closed by the sentinels (CLIENT KILL) or fail with READONLY,
and redis-py turns both into a ConnectionError the caller's reconnect handles.

A malformed URL raises `RedisURLError` (a ConfigError, a ValueError) with one
message naming what is wrong, before any connection is attempted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from proxy.errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel"
TLS_SENTINEL_SCHEME = "rediss+sentinel"
_SENTINEL_SCHEMES = (SENTINEL_SCHEME, TLS_SENTINEL_SCHEME)
_PLAIN_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_QUERY = ("sentinel_password", "sentinel_username")


class RedisURLError(ConfigError, ValueError):
    """A Redis URL that cannot be used; the message names the part that is wrong."""


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False  # rediss+sentinel://: TLS to the sentinels and the data nodes


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a `redis+sentinel://` URL; RedisURLError names what is wrong."""
    scheme, sep, rest = url.partition("://")
    if scheme.lower() not in _SENTINEL_SCHEMES or not sep:
        raise RedisURLError(f"not a {SENTINEL_SCHEME}:// URL: {redact(url)}")
    _check_user_info(url)
    # urlsplit would choke on the comma-separated host list; split by hand.
    rest, _, query = rest.partition("?")
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise RedisURLError(f"{SENTINEL_SCHEME} URL: unexpected '#' fragment")
    authority, _, path = rest.partition("/")
    auth, at, hosts = authority.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon and user:
            # redis-py's rule for redis://: a lone user-info part is the password.
            username, password = None, unquote(user)
    if not hosts:
        raise RedisURLError(f"{SENTINEL_SCHEME} URL: no sentinel host:port before the service name")
    sentinels = tuple(_host_port(item) for item in hosts.split(","))
    parts = path.split("/") if path else []
    if not parts or not parts[0]:
        raise RedisURLError(
            f"{SENTINEL_SCHEME} URL: no service name (expected "
            f"{SENTINEL_SCHEME}://host:port[,host:port...]/service-name[/db])")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1]):
        raise RedisURLError(
            f"{SENTINEL_SCHEME} URL: path {'/' + path!r} is not /service-name[/db]")
    service = unquote(parts[0])
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise RedisURLError(f"{SENTINEL_SCHEME} URL: db {parts[1]!r} is not a number")
        db = int(parts[1])
    options: dict[str, str] = {}
    for key, values in parse_qs(query, keep_blank_values=True, strict_parsing=False).items():
        if key not in _SENTINEL_QUERY:
            raise RedisURLError(
                f"{SENTINEL_SCHEME} URL: unknown option {key!r} "
                f"(known: {', '.join(_SENTINEL_QUERY)})")
        options[key] = values[-1]
    return SentinelURL(
        sentinels=sentinels,
        service=service,
        db=db,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
        tls=scheme.lower() == TLS_SENTINEL_SCHEME,
    )


def _host_port(item: str) -> tuple[str, int]:
    host, colon, port = item.strip().rpartition(":")
    if not colon or not host:
        raise RedisURLError(f"{SENTINEL_SCHEME} URL: sentinel {item!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # an IPv6 literal
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisURLError(f"{SENTINEL_SCHEME} URL: sentinel {item!r} has no valid port")
    return host, int(port)


def _check_user_info(url: str) -> None:
    """Refuse a user-info part with `/`, `?` or `#`: a URL parser cuts it there and its
    error would quote a piece of the password (base64 passwords have `/`)."""
    auth = url.partition("://")[2].rpartition("@")[0]
    if any(c in auth for c in "/?#"):
        raise RedisURLError(f"Redis URL {redact(url)!r}: its user-info has a '/', '?' or "
                            "'#': percent-encode them in the password (%2F, %3F, %23)")


def validate(url: str) -> None:
    """Raise RedisURLError if `url` is not a Redis URL sluice can use (no I/O)."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in _SENTINEL_SCHEMES:
        parse_sentinel_url(url)
        return
    if scheme not in _PLAIN_SCHEMES:
        raise RedisURLError(
            f"Redis URL {redact(url)!r}: scheme must be redis://, rediss://, unix://, "
            f"{SENTINEL_SCHEME}:// or {TLS_SENTINEL_SCHEME}://")
    _check_user_info(url)
    try:
        aioredis.ConnectionPool.from_url(url)
    except ValueError as exc:
        message = str(exc)
        for secret in _secrets(url):
            message = message.replace(secret, "***")
        # Not `from exc`: its message (in every traceback) may quote the password.
        raise RedisURLError(f"Redis URL {redact(url)!r}: {message}") from None


def redis_tls_options(url: str, ca_file: str | None) -> dict[str, Any]:
    """redis-py keyword arguments for `ca_file` (the CA that signed the server's
    certificate; None: the system's). Raises ConfigError for a CA file without TLS."""
    if ca_file is None:
        return {}
    if not url.lower().startswith(("rediss://", f"{TLS_SENTINEL_SCHEME}://")):
        raise ConfigError(f"--redis-ca-file needs a rediss:// or {TLS_SENTINEL_SCHEME}:// "
                          "(TLS) Redis URL")
    if not os.path.isfile(ca_file):
        raise ConfigError(f"--redis-ca-file: no file {ca_file!r}")
    return {"ssl_ca_certs": ca_file}


def client_from_url(url: str, **kwargs: Any) -> aioredis.Redis:
    """A redis-py asyncio client for any accepted URL; no I/O yet.

    `kwargs` go to every data-node connection (socket timeouts, `retry`, `ssl_ca_certs`
    ...); the sentinels get the same socket timeouts and TLS options, and never the
    data nodes' credentials. Closing the client (`aclose()`) also closes its sentinel
    connections.
    """
    validate(url)
    if url.partition("://")[0].lower() not in _SENTINEL_SCHEMES:
        return aioredis.Redis.from_url(url, **kwargs)
    target = parse_sentinel_url(url)
    if target.tls:
        # Certificates verified (redis-py's default CERT_REQUIRED, hostname checked).
        kwargs = {**kwargs, "ssl": True}
    # The data nodes' `retry` too: without it each sentinel client retries with redis-py's
    # default (3 times, backing off up to 10 s), so one dead sentinel, or a certificate
    # that fails to verify, held every discovery for seconds (35 s for a missing CA).
    sentinel_kwargs: dict[str, Any] = {
        k: v for k, v in kwargs.items() if k.startswith(("socket_", "ssl")) or k == "retry"
    }
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        sentinel_kwargs["username"] = target.sentinel_username
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    client: SentinelRedis = sentinel.master_for(
        target.service,
        redis_class=SentinelRedis,
        db=target.db,
        username=target.username,
        password=target.password,
        **kwargs,
    )
    client.sentinel_manager = sentinel
    return client


class SentinelRedis(aioredis.Redis):
    """A client of the primary a Sentinel names; owns (and closes) its sentinel clients."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            sentinel, self.sentinel_manager = self.sentinel_manager, None
            if sentinel is not None:
                await sentinel.aclose()


def redact(url: str) -> str:
    """The URL with every password replaced by ***.

    The user-info ends at the *last* `@`: a password with an unencoded `/`, `?` or `#`
    (base64 passwords have `/`) must not be mistaken for the path or the query. An `@`
    in the query then hides a little more than needed, never less.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    auth, at, rest = rest.rpartition("@")
    rest, qmark, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    if at:
        user = auth.partition(":")[0] if ":" in auth else ""
        authority = f"{user}:***@{authority}"
    if qmark:
        try:
            items = parse_qs(query, keep_blank_values=True)
        except ValueError:
            items = {}
        query = "&".join(
            f"{key}={'***' if 'password' in key else quote(values[-1], safe='')}"
            for key, values in items.items())
    return f"{scheme}://{authority}{slash}{path}{qmark}{query}"


def _secrets(url: str) -> list[str]:
    """The password of `url`'s user-info as written and decoded (for scrubbing messages)."""
    auth, at, _ = url.partition("://")[2].rpartition("@")
    if not at:
        return []
    user, colon, password = auth.partition(":")
    secret = password if colon else user
    return [s for s in {secret, unquote(secret)} if s]


def describe(url: str) -> str:
    """A short, password-free description of where the URL points (for logs)."""
    if url.partition("://")[0].lower() in _SENTINEL_SCHEMES:
        try:
            target = parse_sentinel_url(url)
        except RedisURLError:
            return redact(url)
        hosts = ",".join(f"{h}:{p}" for h, p in target.sentinels)
        return f"sentinel service {target.service!r} via {hosts}"
    return redact(url)
