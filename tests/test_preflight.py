"""The room pre-flight: READY on a machine that runs the course, named problems otherwise."""

import pytest

from course_utils.tools import preflight


def test_preflight_is_ready_here(capsys):
    assert preflight.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("READY: this machine runs the course")
    assert [line.split()[1] for line in out[:-1]] == [name.split()[0] for name, _ in preflight.CHECKS]
    assert all(line.split()[0] == "ok" for line in out[:-1])


def test_a_failing_check_is_named_with_what_to_do_and_nothing_raises(monkeypatch, capsys):
    def broken():
        raise RuntimeError("ipykernel missing: run `make install`\nmore detail")

    monkeypatch.setattr(preflight, "CHECKS", (("pytorch", preflight.CHECKS[0][1]), ("jupyter", broken)))
    assert preflight.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "  FAIL  jupyter       RuntimeError: ipykernel missing: run `make install`"
    assert out[-1].startswith("NOT READY: jupyter failed")


def test_checks_must_be_pairs():
    with pytest.raises(TypeError, match="checks must be a non-empty tuple"):
        preflight.run_checks(())
