"""make lab's working copy: every notebook copied, a learner's files kept, git ignoring all of it."""

import subprocess
import sys
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
    assert len([p for p in copied if p.suffix == ".ipynb"]) == len(notebooks) >= 52  # 13, and 13 per edition
    nb = nbformat.read(tmp_path / "lab" / "01_single_gpu.ipynb", as_version=4)
    assert nb == nbformat.read(ROOT / "notebooks" / "01_single_gpu.ipynb", as_version=4)


#: a notebook, stored as .json so that nbval does not collect it
OLD_COPY = ROOT / "tests" / "data" / "lab_before_the_wings.json"


def test_a_copy_made_before_the_modules_moved_is_brought_up_to_date_and_runs(tmp_path, capsys):
    """A learner's lab/ from before the wings: what the course's notebooks imported then (the fixture
    holds their imports, and what they read from the modules they imported) runs once make lab has
    rewritten it, and the notebook as it was is kept."""
    source, dest = tmp_path / "notebooks", tmp_path / "lab"
    source.mkdir()
    dest.mkdir()
    (dest / "09_old.ipynb").write_bytes(OLD_COPY.read_bytes())
    assert lab.main(["--source", str(source), "--dest", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "the imports of 1 of your notebooks use the new paths now (09_old.ipynb)" in out, out
    assert "no longer has" not in out, out
    assert (dest / lab.BACKUP / "09_old.ipynb").read_bytes() == OLD_COPY.read_bytes()
    updated = nbformat.read(dest / "09_old.ipynb", as_version=4)
    code = [c.source for c in updated.cells if c.cell_type == "code"]
    assert all("course_utils.ddp_train" not in c and "import sharding" not in c for c in code)
    assert lab.update_old_imports(dest) == ([], {})  # a second run changes nothing
    # every cell runs: the imports, the attributes read from imported modules, the modules named
    script = "\n".join(code)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_what_cannot_be_brought_along_is_named_with_what_to_run(tmp_path, capsys):
    source, dest = tmp_path / "notebooks", tmp_path / "lab"
    source.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from course_utils.ddp_demos import hello, no_such_demo\n"
                                          "from course_utils import sharding\n"
                                          "sharding.sharded_ledger, sharding.not_a_ledger")]
    dest.mkdir()
    nbformat.write(nb, dest / "mine.ipynb")
    assert lab.main(["--source", str(source), "--dest", str(dest)]) == 0
    out = capsys.readouterr().out
    assert ("lab/mine.ipynb uses what the course no longer has (course_utils.ddp.demos.no_such_demo, "
            "course_utils.sharding.ledgers.not_a_ledger): run make lab-refresh") in out, out
    cell = nbformat.read(dest / "mine.ipynb", as_version=4).cells[0].source
    assert cell.splitlines()[:2] == ["from course_utils.ddp.demos import hello, no_such_demo",
                                     "from course_utils.sharding import ledgers as sharding"]


def test_the_course_notebooks_use_no_old_path_and_every_name_they_import_exists():
    from course_utils.tools.moved import unresolved, update_cells

    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        assert update_cells(code) == code, path.name
        assert unresolved(code) == [], path.name
