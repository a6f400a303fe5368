"""The README's test command does what the README says (issue 51, item 2): `scripts/test.sh ARGS`
hands ARGS to pytest, and the README shows how to run one area with it. Read, not run: the
suite itself runs through that script."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_test_script_passes_its_arguments_to_pytest():
    script = (ROOT / "scripts" / "test.sh").read_text()
    (pytest_line,) = [line for line in script.splitlines() if "-m pytest" in line]
    assert pytest_line.rstrip().endswith('"$@"'), pytest_line


def test_readme_shows_one_area_run_through_the_test_script():
    readme = (ROOT / "README.md").read_text()
    runs = re.findall(r"`bash scripts/test\.sh (tests/\S+)[^`]*`", readme)
    assert runs, "the README gives no `bash scripts/test.sh tests/<area> ...` example"
    assert all((ROOT / area).exists() for area in runs), runs
