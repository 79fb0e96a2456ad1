"""No reader that stops early at the end of a pipeline in a script under `set -o pipefail`.

`producer | head -n1`, `| grep -q`, `| awk '... exit'`: the reader exits at its first
match, the producer is killed by SIGPIPE while it still writes, and pipefail makes that
the pipeline's status. Whether it happens depends on a race between the two and on how
much the producer writes, so a script can pass a hundred times and then fail on a fresh
machine (`tools/image/build.sh` did: exit 141 reading a base image's dpkg status).
The fix is to capture the producer's output first and test it, or to use a reader that
reads to the end. A line that must keep such a reader says why with `# pipefail-ok: ...`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
EXEMPT = "# pipefail-ok:"


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    reader: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: `{self.reader}` at the end of a pipe under pipefail"


def logical_lines(text: str) -> list[tuple[int, str]]:
    """The script's commands with continuations joined and here-document bodies left out."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        i += 1
        while i < len(lines) and (
            line.endswith("\\") or line.rstrip().endswith("|") or lines[i].lstrip().startswith("|")
        ):
            line = line.removesuffix("\\") + " " + lines[i]
            i += 1
        out.append((start, line))
        if (heredoc := HEREDOC.search(line)) is not None:
            end = heredoc.group(2)
            while i < len(lines) and lines[i].strip() != end:
                i += 1
            i += 1
    return out


def early_reader(words: list[str]) -> str | None:
    """The stage's command if it may stop reading before its input ends, else None."""
    if not words:
        return None
    cmd, args = words[0], words[1:]
    if cmd == "head" or cmd == "read":
        return cmd
    if cmd == "grep":
        for arg in args:
            if arg in ("-q", "--quiet", "--silent", "-l", "-L") or arg.startswith("--max-count"):
                return "grep " + arg
            if re.fullmatch(r"-[A-Za-z]*[qsml][A-Za-z]*\d*", arg) and (
                "q" in arg or "m" in arg or "l" in arg
            ):
                return "grep " + arg
    if cmd == "awk" and any(re.search(r"\bexit\b", a) for a in args):
        return "awk ... exit"
    if cmd == "sed" and any(re.search(r"(^|[;{}\s])q(\d+)?\s*($|[;}])", a) for a in args):
        return "sed ... q"
    return None


def findings(path: Path, root: Path = ROOT) -> list[Finding]:
    text = path.read_text()
    if "pipefail" not in text:
        return []
    found = []
    for number, line in logical_lines(text):
        if EXEMPT in line or "|" not in line:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote the lexer cannot follow: nothing to judge
            continue
        stage: list[str] | None = None
        for token in [*tokens, ";"]:
            if token == "|":
                stage = []
            elif stage is not None and (set(token) <= set("();&|<>") or token == "}"):
                if (reader := early_reader(stage)) is not None:
                    found.append(Finding(str(path.relative_to(root)), number, reader))
                stage = None
            elif stage is not None:
                stage.append(token)
    return found


def scripts() -> list[Path]:
    candidates = [*ROOT.glob("tools/**/*.sh"), ROOT / ".ci" / "run"]
    return sorted(p for p in candidates if p.is_file())


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("x=$(sed -n 's/a/b/p' f | head -n1)", "head"),
        ("dpkg-query -W p | grep -q 'install ok installed' || missing+=(p)", "grep -q"),
        ("v=$(tar -xOf t ./s | awk '/^P/ { p = 1 } p && /^V/ { print $2; exit }')", "awk ... exit"),
        ("printf '%s\\n' a b | grep -qx b", "grep -qx"),
        ("ls | grep -m1 x", "grep -m1"),
        ("cat f | sed -n '1p;q'", "sed ... q"),
        ("producer | read -r first", "read"),
        ("x=$(a | b | tail -n1)", None),
        ("v=$(tar -xOf t ./s | awk '/^V/ && v == \"\" { v = $2 } END { print v }')", None),
        ("grep -qx v file || die nope", None),
        ("a || b | sort", None),
        ('out=$(producer); grep -q x <<<"$out"', None),
        ("producer | head -n1  # pipefail-ok: the producer writes one line", None),
    ],
)
def test_the_rule_flags_readers_that_stop_early(
    line: str, flagged: str | None, tmp_path: Path
) -> None:
    script = tmp_path / "s.sh"
    script.write_text(f"#!/usr/bin/env bash\nset -euo pipefail\n{line}\n")
    got = [f.reader for f in findings(script, root=tmp_path)]
    assert got == ([flagged] if flagged else [])


def test_continued_lines_and_here_documents() -> None:
    text = (
        "set -o pipefail\n"
        "value=$(producer \\\n"
        "  | awk '{ print; exit }')\n"
        "cat > f <<'EOF'\n"
        "a | head -n1\n"
        "EOF\n"
    )
    lines = logical_lines(text)
    assert [n for n, _ in lines] == [1, 2, 4]
    assert "awk" in lines[1][1]


def test_no_script_under_pipefail_ends_a_pipe_with_an_early_reader() -> None:
    assert scripts(), "no scripts found under tools/"
    problems = [str(f) for path in scripts() for f in findings(path)]
    assert problems == []
