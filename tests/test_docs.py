"""The documentation holds together: a short README with its two commands, relative links that
resolve, and generated pages that match what ``tools/gen_docs.py`` makes from the code and data."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300
TWO_COMMANDS = (
    "pip install -e . && python examples/quickstart.py",
    'pip install -e ".[test]" && python -m pytest -q',
)
# [text](target) outside code; the target up to whitespace or ")"
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")


def _markdown_files() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    text = _INLINE_CODE.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
    targets = [match.group(1) for match in _LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("command", TWO_COMMANDS)
def test_the_readme_gives_the_two_commands(command):
    assert command in README.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_an_existing_file(path):
    missing = [target for target in _relative_links(path)
               if not (path.parent / target.split("#", 1)[0]).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_the_link_check_sees_links():
    # guards the regular expressions above: the README does link into docs/
    assert "docs/index.md" in _relative_links(README)


def test_the_generated_docs_are_up_to_date():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
