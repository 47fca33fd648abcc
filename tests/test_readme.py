"""The README's promises: its usage example runs as written, its commands match CI, its reading path's
`file:line` links land on the functions they name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# [`src/plainformer/models/gpt.py:249`](src/plainformer/models/gpt.py#L249) `Block.forward`
LINE_LINK = re.compile(r"\[`(?P<path>src/plainformer/[\w/]+\.py):(?P<line>\d+)`\]\((?P<target>[^)]*)\)"
                       r" `(?P<name>[\w.]+)`")


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def definitions(source: str) -> dict[str, int]:
    """Each function and class of `source` by qualified name (`Block.forward`) -> the line of its `def`."""
    found: dict[str, int] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[prefix + node.name] = node.lineno
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(source).body, "")
    return found


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


def test_each_file_line_of_the_reading_path_is_the_def_it_names():
    text = README.read_text(encoding="utf-8")
    links = list(LINE_LINK.finditer(text))
    assert len(links) >= 5, "the reading path links the block, attention and the train step"
    assert len(links) == len(re.findall(r"src/plainformer/[\w/]+\.py:\d+", text)), \
        "every file:line is written as [`path:line`](path#Lline) `Name.of.def`"
    for link in links:
        path, line, name = link["path"], int(link["line"]), link["name"]
        assert link["target"] == f"{path}#L{line}", f"{path}:{line} links to {link['target']}"
        where = definitions((README.parent / path).read_text(encoding="utf-8")).get(name)
        assert where == line, f"README: {path}:{line} `{name}`, but {name} is at line {where}"
