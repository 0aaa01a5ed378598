"""The code's layering (docs/architecture.md): no import cycle, including imports made
only for the type checker or inside functions; imports go one way between the
packages, and each package imports only what its `MAY_IMPORT` rule allows.
`scripts/import_graph.py` is the check; this runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def graph(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "import_graph.py"), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_no_import_cycle_and_no_layering_breach() -> None:
    result = graph()
    assert "layering breaches: 0\n" in result.stdout, result.stdout
    assert "cycles: 0\n" in result.stdout, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_finds_a_cycle_and_a_breach(tmp_path: Path) -> None:
    """The check itself can fail: a copy of the tree with a TYPE_CHECKING-only cycle and
    a proxy module importing the control plane."""
    for pkg in ("proxy", "controlplane"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "proxy" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proxy import b\n")
    (tmp_path / "proxy" / "b.py").write_text(
        "def f() -> None:\n    from proxy import a\n    import controlplane.c\n")
    (tmp_path / "controlplane" / "c.py").write_text("")
    result = graph("--root", str(tmp_path))
    assert result.returncode == 1
    assert "cycles: 1\n" in result.stdout
    assert "proxy.a->proxy.b[type]" in result.stdout
    assert "proxy.b->proxy.a[lazy]" in result.stdout
    assert "proxy.b -> controlplane.c: proxy never imports controlplane" in result.stdout


def test_each_package_imports_only_what_its_rule_allows(tmp_path: Path) -> None:
    """The per-package rules (`MAY_IMPORT` in the script): a backend importing the store,
    the spec importing the records, and a package with no rule are breaches."""
    for pkg in ("proxy", "proxy/wire", "controlplane", "controlplane/backends",
                "controlplane/store", "controlplane/servicespec",
                "controlplane/newpkg"):  # fmt: skip
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "controlplane" / "records.py").write_text("")
    (tmp_path / "controlplane" / "store" / "facade.py").write_text("")
    (tmp_path / "controlplane" / "backends" / "local.py").write_text(
        "from controlplane.records import X\nfrom controlplane.store import facade\n")
    (tmp_path / "controlplane" / "servicespec" / "schema.py").write_text(
        "import controlplane.records\nfrom proxy.wire import Y\n")
    (tmp_path / "controlplane" / "newpkg" / "m.py").write_text("import controlplane.records\n")
    result = graph("--root", str(tmp_path))
    assert result.returncode == 1
    assert "layering breaches: 3\n" in result.stdout, result.stdout
    assert ("controlplane.backends.local -> controlplane.store.facade: controlplane.backends "
            "may import only") in result.stdout
    assert ("controlplane.servicespec.schema -> controlplane.records: "
            "controlplane.servicespec may import only proxy.wire\n") in result.stdout
    assert ("controlplane.newpkg.m -> controlplane.records: package controlplane.newpkg has no "
            "MAY_IMPORT rule") in result.stdout
