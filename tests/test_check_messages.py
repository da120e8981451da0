"""What ``check`` prints: wrapped at word boundaries, its first line in the form make compat reads."""

import re

import pytest

from course_utils.exercises import check, core
from course_utils.tools.compat_check import _VERDICT

LONG_HINT = ("your ranks never reached the all_reduce: rank 1 waited in dist.barrier() while rank 0 "
             "was in torch.distributed.all_reduce, so every rank must call the same collectives in "
             "the same order; see course_utils/debugging/failure_zoo.py and TORCH_DISTRIBUTED_DEBUG=DETAIL "
             "(--nproc-per-node=2 on a machine-with-a-hyphenated-name)")


def _words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize("status, hint", [("not yet", LONG_HINT), ("right", ""),
                                          ("not attempted yet", ""), ("not yet", "short")])
def test_a_message_is_wrapped_between_words_and_keeps_its_first_line(status, hint, monkeypatch, capsys):
    result = core.Verdict("12.12", "implement", status, hint)
    monkeypatch.setattr(core, "verdict", lambda key, answer: result)
    check("12.12", 1)
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert all(len(line) <= core._MESSAGE_WIDTH for line in lines), lines
    assert _words(printed) == _words(str(result))  # no word broken, lost or added
    assert all(line.startswith("  ") and not line.startswith("   ") for line in lines[1:])
    mark, key, kind, rest = _VERDICT.findall(printed)[0]
    assert (key, kind) == ("12.12", "implement") and rest.startswith(f"{status}.")
    # a line ends only where the next word no longer fits
    for line, following in zip(lines, lines[1:], strict=False):
        assert len(line) + 1 + len(following.split()[0]) > core._MESSAGE_WIDTH, (line, following)
    assert (len(lines) > 1) == (len(str(result)) > core._MESSAGE_WIDTH)


def test_a_real_check_prints_one_wrapped_message(capsys):
    check("01.2", 5)
    printed = capsys.readouterr().out
    assert re.match(r"✗ Exercise 01\.2 \(predict\): not yet\. ", printed)
    assert "only four calls" in " ".join(printed.split())
    assert all(len(line) <= core._MESSAGE_WIDTH for line in printed.splitlines())


def test_a_word_longer_than_the_line_stays_whole(capsys, monkeypatch):
    path = "/".join(["a_very_long_folder_name"] * 6)
    result = core.Verdict("03.2", "fix", "not yet", f"look at {path} first")
    monkeypatch.setattr(core, "verdict", lambda key, answer: result)
    check("03.2", 1)
    assert path in capsys.readouterr().out.splitlines()[1]
