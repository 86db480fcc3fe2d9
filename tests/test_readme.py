"""README.md's quick start runs as written: the first ```python block after the "## Quick start" heading is
executed in a fresh namespace."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_block(text: str) -> str:
    section = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if section is None:
        pytest.fail("README.md has no '## Quick start' section")
    block = re.search(r"^```python\n(.*?)^```", section.group(1), re.S | re.M)
    if block is None or not block.group(1).strip():
        pytest.fail("README.md's quick start has no ```python block")
    return block.group(1)


def test_quick_start_runs(capsys):
    code = quick_start_block(README.read_text(encoding="utf-8"))
    namespace = {"__name__": "readme_quick_start"}
    exec(compile(code, "README.md:quick-start", "exec"), namespace)
    result, tree, budget = namespace["result"], namespace["tree"], namespace["budget"]
    batch = tree.tokens.shape[0]
    assert tree.tokens.shape == (batch, budget + 1)
    assert result.tokens.shape == (batch, tree.max_depth + 1)
    assert capsys.readouterr().out.strip()  # it prints the emitted tokens


def test_missing_block_fails():
    with pytest.raises(pytest.fail.Exception):
        quick_start_block("# title\n\n## Quick start\n\nno code here\n\n## Next\n```python\nx = 1\n```\n")
