"""The installs must not drift: exact pins, the same in requirements.txt and environment.yml."""

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
def _exact_pins(lines: list[str], where: str) -> dict[str, str]:
    """``{name: version}`` of requirement lines, each of which must pin one exact version."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for line in lines:
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{where}: {line!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{where} pins {name} twice"
        pins[name] = specs[0].version
    return pins


def requirement_pins() -> dict[str, str]:
    lines = [raw.split("#")[0].strip() for raw in (ROOT / "requirements.txt").read_text().splitlines()]
    return _exact_pins([line for line in lines if line], "requirements.txt")


def environment_pins() -> tuple[dict[str, str], list[str]]:
    import yaml

    dependencies = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda = [d for d in dependencies if isinstance(d, str)]
    pip = [d for d in dependencies if isinstance(d, dict) and "pip" in d]
    assert len(pip) == 1, "environment.yml: expected one pip section"
    return _exact_pins(pip[0]["pip"], "environment.yml"), conda


def test_torch_is_pinned_exactly():
    assert requirement_pins()["torch"] == "2.13.0"


def test_the_preflight_expects_the_pinned_torch():
    from course_utils.tools.preflight import TORCH_PIN

    assert TORCH_PIN == requirement_pins()["torch"]


def test_environment_yml_carries_the_same_pins():
    pins = requirement_pins()
    pip, conda = environment_pins()
    assert pip == pins, {
        "only in requirements.txt": sorted(set(pins) - set(pip)),
        "only in environment.yml": sorted(set(pip) - set(pins)),
        "different versions": sorted(k for k in pins.keys() & pip.keys() if pins[k] != pip[k]),
    }
    assert "python=3.11" in conda and "pip" in conda


@pytest.mark.parametrize("name", sorted(requirement_pins()))
def test_installed_versions_match_the_pins(name):
    """The environment running the tests is the pinned one (no drift after a manual install)."""
    try:
        installed = version(name)
    except PackageNotFoundError:
        pytest.fail(f"{name} is pinned but not installed: run `make install`")
    assert installed.split("+")[0] == requirement_pins()[name]


def _dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def ci_commands() -> list[str]:
    """The command of each line of .ci/run, without what follows it: a redirection, ``&`` (a step
    may run in the background), ``;``, ``||`` or a pipe."""
    return [re.match(r"[^<>&|;]*", line).group().strip() for line in
            (ROOT / ".ci" / "run").read_text().splitlines()]


def _ci_compat_releases() -> set[str]:
    """The releases .ci/run checks with `make compat`: one line each, or all of them side by side
    with `make compat-all` (the Makefile's COMPAT_RELEASES)."""
    from course_utils.tools.compat_check import DEFAULT_TORCH

    commands = ci_commands()
    checked = {DEFAULT_TORCH if line == "make compat" else line.removeprefix("make compat TORCH=")
               for line in commands if line.startswith("make compat") and line != "make compat-all"}
    if "make compat-all" in commands:
        listed = re.search(r"^COMPAT_RELEASES := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
        checked |= set(listed.group(1).split())
    return checked


def test_the_torch_floor_is_the_oldest_release_make_compat_passes_on():
    """The floor is a fact: CI runs `make compat` on the oldest tested release, the Makefile's default."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    from course_utils.tools.compat_check import DEFAULT_TORCH, TESTED_RELEASES

    torch_req = next(Requirement(d) for d in _dependencies() if Requirement(d).name == "torch")
    floors = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    oldest = min(TESTED_RELEASES, key=Version)
    assert floors == [Version(".".join(oldest.split(".")[:2]))], (str(torch_req.specifier), oldest)
    assert DEFAULT_TORCH == oldest and requirement_pins()["torch"] in TESTED_RELEASES
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^TORCH \?= {re.escape(DEFAULT_TORCH)}$", makefile, re.MULTILINE)
    assert DEFAULT_TORCH in _ci_compat_releases(), "CI must run make compat on the floor, or it is a claim"
    readme = (ROOT / "README.md").read_text()
    assert all(release in readme for release in TESTED_RELEASES)


def test_ci_runs_make_compat_on_every_tested_release_but_the_pin():
    """A tested release is one CI checks: the pin by nbval, every other one by `make compat`
    (one line each, or all of them side by side with `make compat-all`: the Makefile's list)."""
    from course_utils.tools.compat_check import TESTED_RELEASES

    ci = ci_commands()
    checked = _ci_compat_releases()
    others = set(TESTED_RELEASES) - {requirement_pins()["torch"]}
    assert checked == others and len(others) >= 2, (checked, TESTED_RELEASES)
    assert "make test" in ci  # nbval: the pin
    assert "2.14.1" in TESTED_RELEASES  # the newest release that installs on Python 3.11, 2026-11
    which = (ROOT / "README.md").read_text().split("**Which PyTorch.**")[1].split("\n\n")[0]
    minors = [".".join(r.split(".")[:2]) for r in TESTED_RELEASES]
    assert all(r in which for r in TESTED_RELEASES), which
    assert f"{', '.join(minors[:-1])} and {minors[-1]}" in which, which


def test_every_third_party_module_the_package_imports_is_a_declared_dependency():
    """A plain `pip install` (Colab's set-up cell) must bring whatever course_utils imports."""
    import ast
    import sys
    from importlib.metadata import packages_distributions

    from packaging.requirements import Requirement

    declared = {Requirement(d).name.lower() for d in _dependencies()}
    distributions = packages_distributions()
    imported = set()
    for path in (ROOT / "course_utils").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = sorted(m for m in imported - {"course_utils", "__future__"}
                         if m not in sys.stdlib_module_names)
    assert "psutil" in third_party and "torch" in third_party  # the walk sees lazy imports too
    undeclared = [m for m in third_party
                  if not {d.lower() for d in distributions.get(m, [m])} & declared]
    assert undeclared == [], f"imported by course_utils but not in pyproject's dependencies: {undeclared}"
