"""Shared fixtures live in plugin modules, one per concern."""

pytest_plugins = [
    "tests.fixtures_redis",
    "tests.fixtures_replicas",
]
