"""Shared fixtures live in plugin modules under tests/support/, one per concern."""

pytest_plugins = [
    "tests.support.redis_fixtures",
    "tests.support.processes",
    "tests.support.llama",
    "tests.support.engine_fakes",
    "tests.support.fakes",
    "tests.support.skyserve_stub",
]
