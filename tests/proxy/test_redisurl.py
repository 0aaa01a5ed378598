"""proxy.redisurl: the forms of --redis, parsed without I/O."""

from __future__ import annotations

import pytest

from proxy.redisurl import (
    RedisURLError,
    SentinelRedis,
    SentinelURL,
    client_from_url,
    parse_sentinel_url,
    redact,
    validate,
)


def test_sentinel_url_with_every_part() -> None:
    url = ("redis+sentinel://app:p%40ss@10.0.0.1:26379,10.0.0.2:26380,[::1]:26381/my-svc/3"
           "?sentinel_password=s3cret&sentinel_username=sent")
    assert parse_sentinel_url(url) == SentinelURL(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381)),
        service="my-svc", db=3, username="app", password="p@ss",
        sentinel_username="sent", sentinel_password="s3cret")


def test_sentinel_url_defaults() -> None:
    assert parse_sentinel_url("redis+sentinel://h:1/svc") == SentinelURL(
        sentinels=(("h", 1),), service="svc")
    assert parse_sentinel_url("redis+sentinel://:pw@h:1/svc").password == "pw"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis+sentinel://h:99999/svc", "sentinel 'h:99999' has no valid port"),
        ("redis+sentinel://h:1,/svc", "sentinel '' is not host:port"),
        ("redis+sentinel://h:1/svc/0/extra", "is not /service-name[/db]"),
        ("redis+sentinel://h:1//0", "no service name"),
        ("redis+sentinels://h:1/svc", "scheme must be"),
        ("127.0.0.1:6379", "scheme must be"),
        ("redis://127.0.0.1:port/0", "Redis URL"),
    ],
)
def test_errors_name_the_part_that_is_wrong(url: str, needle: str) -> None:
    with pytest.raises(RedisURLError) as info:
        validate(url)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_redact_hides_every_password() -> None:
    url = "redis+sentinel://u:data@h:1,h:2/svc?sentinel_password=sent"
    text = redact(url)
    assert "data" not in text and "sentinel_password=***" in text and "h:1,h:2/svc" in text
    assert redact("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"


async def test_client_from_url_builds_a_sentinel_managed_client() -> None:
    client = client_from_url("redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/svc/2",
                             socket_timeout=1.0)
    try:
        assert isinstance(client, SentinelRedis)
        pool = client.connection_pool
        assert pool.service_name == "svc"  # type: ignore[attr-defined]
        assert pool.connection_kwargs["db"] == 2
        assert pool.connection_kwargs["password"] == "pw"
        manager = client.sentinel_manager
        assert manager is not None and len(manager.sentinels) == 2
    finally:
        await client.aclose()
    assert client.sentinel_manager is None
