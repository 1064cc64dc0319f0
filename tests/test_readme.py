"""The README's two set-up commands exist, and CI runs exactly the README's test command."""

from __future__ import annotations

import re

from conftest import REPO_ROOT


def _setup_commands() -> list[str]:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick_start, flags=re.S)]


def test_readme_has_exactly_two_setup_commands():
    commands = _setup_commands()
    assert len(commands) == 2 and all("\n" not in command for command in commands)
    assert "launch/pretrain.sh" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci_lines = [line.strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    assert _setup_commands()[1] in ci_lines
