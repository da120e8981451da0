"""The installs must not drift: exact pins, the same in requirements.txt and environment.yml."""

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;=<>~!]+)$")


def requirement_pins() -> dict[str, str]:
    pins = {}
    for raw in (ROOT / "requirements.txt").read_text().splitlines():
        line = raw.split("#")[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        assert match, f"requirements.txt: {line!r} is not an exact pin (name==version)"
        name = match.group(1).lower().replace("_", "-")
        assert name not in pins, f"requirements.txt pins {name} twice"
        pins[name] = match.group(2)
    return pins


def environment_pins() -> tuple[dict[str, str], list[str]]:
    text = (ROOT / "environment.yml").read_text()
    conda, pip, in_pip = [], {}, False
    for raw in text.splitlines():
        line = raw.split("#")[0].rstrip()
        if re.match(r"^\s+- pip:\s*$", line):
            in_pip = True
            continue
        item = re.match(r"^(\s+)- (\S.*)$", line)
        if not item:
            continue
        if in_pip and len(item.group(1)) > 4:
            name, _, ver = item.group(2).partition("==")
            pip[name.strip().lower().replace("_", "-")] = ver.strip()
        else:
            in_pip = False
            conda.append(item.group(2).strip())
    return pip, conda


def test_torch_is_pinned_exactly():
    assert requirement_pins()["torch"] == "2.13.0"


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
