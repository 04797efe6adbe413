"""requirements.lock (the versions the tests pass on) agrees with pyproject.toml's bounds."""

from __future__ import annotations

import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None


def _locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line!r}"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _declared() -> list[Requirement]:
    if tomllib is None:
        import pytest

        pytest.skip("reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    own = canonicalize_name(project["name"])

    def expand(texts: list[str]) -> list[Requirement]:
        out = []
        for requirement in map(Requirement, texts):
            if canonicalize_name(requirement.name) == own:  # an extra of this package
                out += expand([r for extra in requirement.extras for r in extras[extra]])
            else:
                out.append(requirement)
        return out

    # What `make install` installs: the package, the example's extra and the dev tools.
    return expand([*project["dependencies"], *extras["template"], *extras["dev"]])


def test_every_dependency_is_locked_within_its_bounds():
    pins = _locked()
    for requirement in _declared():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is in pyproject.toml but not locked"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]}, outside {requirement}: run make lock"
        )


def test_the_lock_pins_every_package_exactly_once():
    lines = [
        canonicalize_name(line.partition("==")[0])
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(lines) == len(set(lines))
