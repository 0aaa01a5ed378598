"""The lock (requirements/ci.txt) agrees with pyproject.toml.

Every runtime and test/loadtest requirement of the package is pinned in the lock,
and the pinned version satisfies the range pyproject declares. A range changed
without a `bash requirements/refresh` fails here, not on a fresh machine.
"""

from __future__ import annotations

import tomllib

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.processes import REPO as ROOT

LOCK = ROOT / "requirements" / "ci.txt"


def _pins() -> dict[str, tuple[Version, Marker | None]]:
    pins: dict[str, tuple[Version, Marker | None]] = {}
    for raw in LOCK.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"not an exact pin: {raw!r}"
        pins[canonicalize_name(req.name)] = (Version(specs[0].version), req.marker)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in ("test", "loadtest"):
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def test_every_declared_requirement_is_pinned_within_its_range() -> None:
    pins = _pins()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in pyproject.toml but not in {LOCK.name}"
        version, _ = pins[name]
        assert req.specifier.contains(version, prereleases=True), (
            f"{LOCK.name} pins {req.name}=={version}, outside pyproject's {req.specifier}"
        )


def test_lock_pins_only_exact_versions_and_not_sluice_itself() -> None:
    pins = _pins()
    assert "sluice" not in pins
    assert len(pins) > 20  # the whole closure, not only the direct requirements
