"""The README's example runs as written and does what it says."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "README lost its python example"
    for block in blocks:  # each example runs on its own, as a reader would paste it
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    # anchors of T=10, W=4 with shared anchors; one backward call through them
    assert "[0, 3, 6, 9] 1 16" in out
    # the deferred adaptive example: round(4 * B) anchor pairs, each run once with grad
    assert "\n16 16\n" in out
    # the runaway guard's loop: a converging toy never trips it
    assert "runaway guard: linear" in out
    # the gradient_fidelity example prints its report
    assert "cosine(jagg, exact)" in out and "routed CosineRouter" in out


def test_readme_has_exactly_two_setup_and_go_commands():
    text = README.read_text(encoding="utf-8")
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(commands) == 2
    assert "python -m jagg_autograd.demo" in commands[0]
    assert "pytest" in commands[1] and ".[test]" in commands[1]
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    # CI installs exactly as the README's test command says.
    assert 'pip install -q torch==2.13.0 && pip install -q -e ".[test]"' in ci
