"""make lab's working copy: every notebook copied, a learner's files kept, git ignoring all of it."""

import subprocess
from pathlib import Path

import nbformat

from course_utils.tools import lab

ROOT = Path(__file__).resolve().parents[1]


def _course(tmp_path: Path) -> Path:
    source = tmp_path / "notebooks"
    for rel in ("01_a.ipynb", "02_b.ipynb", "instructor-guide.md", "ko/01_a.ipynb", "ko/README.md",
                "ko/po/01_a.po", ".ipynb_checkpoints/01_a-checkpoint.ipynb"):
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_text(f"course {rel}\n")
    return source


def test_the_copy_holds_what_a_learner_opens_and_no_po_files(tmp_path):
    source, dest = _course(tmp_path), tmp_path / "lab"
    copied = lab.copy_course(source, dest)
    assert [p.as_posix() for p in copied] == ["01_a.ipynb", "02_b.ipynb", "instructor-guide.md",
                                              "ko/01_a.ipynb", "ko/README.md"]
    assert (dest / "ko/01_a.ipynb").read_text() == "course ko/01_a.ipynb\n"
    assert not (dest / "ko/po").exists() and not (dest / ".ipynb_checkpoints").exists()


def test_a_learners_files_stay_and_a_changed_course_is_named_until_a_refresh(tmp_path, capsys):
    source, dest = _course(tmp_path), tmp_path / "lab"
    lab.copy_course(source, dest)
    (dest / "01_a.ipynb").write_text("my outputs\n")
    (dest / "mine.ipynb").write_text("my own notebook\n")
    (source / "03_c.ipynb").write_text("course 03\n")  # a git pull brings a notebook and a change
    (source / "02_b.ipynb").write_text("course 02, corrected\n")
    argv = ["--source", str(source), "--dest", str(dest)]
    assert lab.main(argv) == 0
    out = capsys.readouterr().out
    assert "copied 1 files" in out and "has changed 1 of them since your copy (02_b.ipynb)" in out
    assert (dest / "01_a.ipynb").read_text() == "my outputs\n" and (dest / "03_c.ipynb").exists()
    assert lab.main([*argv, "--refresh"]) == 0
    assert "previous copy is in lab.previous/" in capsys.readouterr().out
    assert (dest / "01_a.ipynb").read_text() == "course 01_a.ipynb\n"
    assert (dest / "02_b.ipynb").read_text() == "course 02, corrected\n"
    assert not (dest / "mine.ipynb").exists()
    previous = tmp_path / "lab.previous"
    assert (previous / "01_a.ipynb").read_text() == "my outputs\n" and (previous / "mine.ipynb").exists()
    assert lab.updated_since_copy(source, dest) == []


def test_git_ignores_the_working_copy_and_a_run_saved_in_it(tmp_path):
    """A learner's Run All and save through make lab writes only under lab/ (and lab.previous/)."""
    names = [f"lab/{p.as_posix()}" for p in lab.course_files(ROOT / "notebooks")]
    assert "lab/01_single_gpu.ipynb" in names and "lab/ko/01_single_gpu.ipynb" in names
    written = [*names, "lab/.course-copy.json", "lab/.ipynb_checkpoints/01_single_gpu-checkpoint.ipynb",
               "lab/checkpoints/run.pt", "lab.previous/01_single_gpu.ipynb"]
    result = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", *written], cwd=ROOT,
                            capture_output=True, text=True)
    ignored = [line.split("\t")[1] for line in result.stdout.splitlines()]
    assert ignored == written, set(written) - set(ignored)


def test_a_copied_notebook_is_the_course_notebook(tmp_path):
    copied = lab.copy_course(ROOT / "notebooks", tmp_path / "lab")
    notebooks = [p for p in (ROOT / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts]
    assert len([p for p in copied if p.suffix == ".ipynb"]) == len(notebooks) >= 44  # 11, and 11 per edition
    nb = nbformat.read(tmp_path / "lab" / "01_single_gpu.ipynb", as_version=4)
    assert nb == nbformat.read(ROOT / "notebooks" / "01_single_gpu.ipynb", as_version=4)
