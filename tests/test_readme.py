"""The README's promises: its usage example runs as written, its commands match CI."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_usage_example_runs_as_written(capsys):
    exec(compile(code_blocks("python")[0], str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "torch.Size([2, 10, 64]) torch.Size([2, 8, 10, 10])" in printed
    assert "torch.Size([1, 21])" in printed


def test_ci_runs_exactly_the_readme_test_command_then_its_checks():
    test_command, checks = (block.strip() for block in code_blocks("bash")[1:3])
    lines = (README.parent / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in lines and checks in lines
    assert lines.index(test_command) < lines.index(checks)
