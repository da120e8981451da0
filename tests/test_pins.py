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


def test_the_preflight_expects_the_pinned_torch():
    from course_utils.preflight import TORCH_PIN

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


#: The torch APIs the course calls that are newer than torch 2.0, with the release that added them.
#: pyproject's floor must be at least the newest of these (Colab installs against it).
TORCH_APIS = {
    "torch.get_autocast_dtype": "2.4",          # course_utils.amp
    "torch.amp.GradScaler": "2.3",              # GradScaler("cpu") in course_utils.amp
    "torch.distributed.init_process_group(device_id)": "2.3",  # course_utils.devices.init_kwargs
}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def _floor() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch>=([\d.]+)"', text)
    assert match, "pyproject.toml must give torch a floor (torch>=X.Y)"
    return match.group(1)


def test_the_torch_floor_covers_every_api_the_course_calls():
    import inspect

    import torch
    import torch.distributed as dist

    assert callable(torch.get_autocast_dtype)
    assert "device" in inspect.signature(torch.amp.GradScaler.__init__).parameters
    assert "device_id" in inspect.signature(dist.init_process_group).parameters
    newest = max(TORCH_APIS.values(), key=_version_tuple)
    assert _version_tuple(_floor()) >= _version_tuple(newest), (
        f"pyproject's torch floor {_floor()} is older than {newest}, which the course needs")
    assert _version_tuple(torch.__version__) >= _version_tuple(_floor())


def test_the_floor_is_not_older_than_the_code_uses():
    """Every listed API is really called by the package, so the table cannot go stale silently."""
    source = "\n".join(p.read_text() for p in (ROOT / "course_utils").glob("*.py"))
    for api in ("get_autocast_dtype", "GradScaler(", "init_kwargs("):
        assert api in source, f"{api} is no longer used: update TORCH_APIS"
