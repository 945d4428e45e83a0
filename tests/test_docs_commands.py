"""Every shell command the README and the docs show works on a fresh clone as written.

A fresh machine has the repository and Python, not ``.venv/bin`` on its ``PATH``: a
bare ``torchrun ...`` or ``zero3-consolidate ...`` copied from a page fails with
``command not found``. So each command shown in a bash/console code block must start with
``./dev JOB`` (``./dev run CMD`` for anything the environment provides, CMD being one of
its executables), or with a tool the page is about that the user brings (pip for their own
environment, Slurm's ``srun`` in front of such a command); after a block's ``source
ENV/bin/activate`` (the GPU cluster's own environment) its commands are that
environment's. Inline commands and the usage lines of the scripts' docstrings (their
``--help``) must not start bare either.
"""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the environment ./dev run puts first on PATH
DEV_JOBS = set(re.findall(r"(?m)^    ([a-z]+)\)$", (ROOT / "dev").read_text()))
#: Tools a user brings: pip installs zero3 into their own environment (docs/installing);
#: srun (Slurm) starts the command that follows it, which is checked in turn.
BROUGHT = {"pip"}
WRAPPERS = {"srun"}
#: What only the environment provides: never shown bare.
ENV_ONLY = re.compile(r"^(?:\.venv/bin/\w|torchrun |mpiexec |zero3-consolidate |python3? )")

_MD_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
_RST_BLOCK = re.compile(r"^( *)\.\. code-block:: *(\w+)\n((?:\1 +.*\n|[ \t]*\n)+)", re.M)
SHELLS = {"bash", "console", "sh", "shell"}


def shell_blocks(text: str, markdown: bool) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced / code-block block."""
    found = []
    if markdown:
        for m in _MD_BLOCK.finditer(text):
            found.append((m.group(1), text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    else:
        for m in _RST_BLOCK.finditer(text):
            found.append((m.group(2), text.count("\n", 0, m.start(3)) + 1, m.group(3)))
    return [b for b in found if b[0] in SHELLS]


def commands(language: str, body: str) -> list[tuple[int, str]]:
    """(offset, command) of each command a block shows: continuation lines joined,
    comments and (console) output lines dropped."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for i, raw in enumerate(body.splitlines()):
        line = raw.strip()
        if pending is not None:
            line, pending = pending[1] + " " + line, (pending[0], "")
            start = pending[0]
        else:
            start = i
            if language == "console":
                if not line.startswith("$ "):
                    continue  # the command's output
                line = line[2:]
        if line.endswith("\\"):
            pending = (start, line[:-1])
            continue
        pending = None
        if line and not line.startswith("#"):
            out.append((start, line))
    return out


def problem(command: str) -> str | None:
    """Why ``command`` would not run on a fresh clone, or None."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^\w+=", words[0]):
        if words[0].split("=", 1)[1].startswith("$("):
            return None  # a variable set from a command substitution (Slurm's scontrol)
        words = words[1:]  # VAR=value before the command
    if not words:
        return None
    if words[0] in WRAPPERS:
        rest = [w for w in words[1:]]
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        return problem(shlex.join(rest)) if rest else f"{words[0]} starts nothing"
    if words[0] in BROUGHT:
        return None
    if words[0] != "./dev":
        return f"starts with {words[0]!r}: use ./dev run {words[0]} (or a ./dev job)"
    if len(words) < 2 or words[1] not in DEV_JOBS:
        return f"./dev has no job {words[1:2]}; it has {sorted(DEV_JOBS)}"
    if words[1] == "run" and (len(words) < 3 or not (BIN / words[2]).exists()):
        return f"./dev run {words[2:3]}: the environment has no such command"
    return None


def problems_in(text: str, markdown: bool, name: str) -> list[str]:
    """Every shown command of a page that would not run, as 'page:line: command: why'."""
    found = []
    for language, first, body in shell_blocks(text, markdown):
        activated = False
        for offset, command in commands(language, body):
            words = command.split()
            if words[0] in ("source", ".") and words[1].strip('"').endswith("/bin/activate"):
                activated = True  # an environment of the user's own: what follows is its
                continue
            why = None if activated else problem(command)
            if why is not None:
                found.append(f"{name}:{first + offset}: {command}: {why}")
    inline = r"(?<!`)`([^`\n]+)`(?!`)" if markdown else r"``([^`]+)``"
    for m in re.finditer(inline, text):
        if ENV_ONLY.match(m.group(1)):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{name}:{line}: ``{m.group(1)}``: prefix it with ./dev run")
    return found


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.rst"))]


def test_every_shown_command_runs_on_a_fresh_clone():
    found = []
    for page in pages():
        text = page.read_text()
        found += problems_in(text, page.suffix == ".md", str(page.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_the_pages_do_show_commands():
    shown = [c for p in pages() for lang, _, b in shell_blocks(p.read_text(), p.suffix == ".md")
             for _, c in commands(lang, b)]  # fmt: skip
    assert len(shown) > 30
    assert any(c.startswith("./dev run torchrun ") for c in shown)
    assert any(c.startswith("./dev run mpiexec ") for c in shown)


def test_scripts_usage_lines_do_not_start_bare():
    """The usage lines of tools/*.py and examples/*.py (their --help and docs)."""
    found = []
    for script in sorted([*ROOT.glob("tools/*.py"), *ROOT.glob("examples/*.py")]):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        for line in doc.splitlines():
            if line.startswith("    ") and ENV_ONLY.match(line.strip()):
                found.append(f"{script.relative_to(ROOT)}: {line.strip()}")
            elif line.startswith("    ./dev") and (why := problem(line.strip())):
                found.append(f"{script.relative_to(ROOT)}: {line.strip()}: {why}")
    assert not found, "\n".join(found)


def test_the_check_refuses_bare_commands():
    rst = """
.. code-block:: bash

   torchrun --standalone --nproc-per-node 2 examples/quickstart.py
   ./dev run torchrun --standalone --nproc-per-node 2 \\
       examples/quickstart.py
   srun torchrun --nnodes 2 script.py

.. code-block:: bash

   source env/bin/activate
   srun torchrun --nnodes 2 script.py

.. code-block:: console

   $ .venv/bin/python -m pytest -q
   1 passed
   $ ./dev tset

Prose: ``zero3-consolidate CKPT OUT``.
"""
    found = problems_in(rst, markdown=False, name="page.rst")
    assert [f.split(": ", 1)[0] for f in found] == [
        "page.rst:4", "page.rst:7", "page.rst:16", "page.rst:18", "page.rst:20",
    ]  # fmt: skip
    assert "use ./dev run torchrun" in found[0]
    assert "./dev has no job ['tset']" in found[3]
    md = "```bash\n./dev run zero3-consolidate ckpt out\n./dev run nosuchtool\n```\n`torchrun -h`"
    found = problems_in(md, markdown=True, name="README.md")
    assert [f.split(": ", 1)[0] for f in found] == ["README.md:3", "README.md:5"]


#: Columns a code block shows without scrolling at a 1280-px window (furo's 46em content
#: column fits about 94 of its monospace characters; examples/ruff.toml formats to this).
CODE_COLUMNS = 88
_INCLUDE = re.compile(r"^( *)\.\. literalinclude:: +(\S+)\n((?:\1 +:.*\n)*)", re.M)


def included(page: Path) -> list[tuple[Path, list[str]]]:
    """(file, lines shown) of each literalinclude of a page, as Sphinx selects them
    (``:pyobject:``, ``:start-at:``, ``:end-at:``, the options the pages use)."""
    found = []
    for m in _INCLUDE.finditer(page.read_text()):
        path = (page.parent / m.group(2)).resolve()
        options = dict(re.findall(r":([\w-]+):[ \t]*(.*)", m.group(3)))
        unknown = set(options) - {"language", "pyobject", "start-at", "end-at"}
        assert not unknown, f"{page.name}: {path.name}: options this check does not read: {unknown}"
        lines = path.read_text().splitlines()
        if "pyobject" in options:
            tree = ast.parse(path.read_text())
            node = next(
                n for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == options["pyobject"]
            )  # fmt: skip
            lines = lines[node.lineno - 1 : node.end_lineno]
        if "start-at" in options:
            lines = lines[next(i for i, x in enumerate(lines) if options["start-at"] in x) :]
        if "end-at" in options:
            lines = lines[: next(i for i, x in enumerate(lines) if options["end-at"] in x) + 1]
        found.append((path, lines))
    return found


def test_included_code_fits_the_page():
    """No line of an excerpt scrolls off the code block, and none shows ``# fmt: skip``."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.rst")):
        for path, lines in included(page):
            for line in lines:
                if len(line) > CODE_COLUMNS or "fmt: skip" in line:
                    found.append(f"{page.name}: {path.relative_to(ROOT)}: {line}")
    assert not found, "\n".join(found)
    assert sum(len(included(p)) for p in (ROOT / "docs").glob("*.rst")) >= 25
