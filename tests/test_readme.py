"""The README's quick start stays the command CI runs."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    quick = bash_blocks()[:2]
    assert all(len(block.strip().splitlines()) == 1 for block in quick)
    run, test = (block.strip() for block in quick)
    assert "specserve generate" in run and "--" not in run.split("generate", 1)[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines
