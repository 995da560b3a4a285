"""README.md's sample outputs are what the commands print today: each marked sample is run in-process and compared.

A sample is a fenced block right after a marker line ``<!-- sample: plan ARGS -->``. A plain block holds the
command's output (stdout; for a command that fails, its ``plan: error: ...`` line on stderr); a ``bash`` block
opens with the command itself (it must be the marker's) and holds the output as ``# `` comments. One line ``...``
(``# ...``) may stand for any lines in between: the lines above it are compared with the output's first lines,
those below with its last. What is normalised, and nothing else:

* the ``search:`` line's seconds (the planner's own wall time) read ``X s``;
* this checkout's path, and the scratch directory the commands run in, read as relative paths (the summary names
  the model file by its absolute path, ``--out`` files by theirs).

The commands run in a scratch directory (``examples`` linked in) with an empty autoplan cache
(``AUTOPLAN_CACHE_DIR``), so no calibration or ``plan tune`` correction of this machine reaches them; a
``local-cpu`` sample must carry ``--no-calibrate``. ``python -m tests.test_readme_samples --update`` rewrites
every marked block with what its command prints now (elisions kept where they are).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
MARKER = re.compile(r"^(?P<indent> *)<!-- sample: (?P<command>plan .*?) -->$")
ELISION = "..."
SEARCH_SECONDS = re.compile(r"\d+(?:\.\d+)? s\b")
SLOW_SAMPLES = ("--nodes 2",)  # GPT-350M searched on 16 GPUs (about 20 s): run with the slow tests


@dataclass(frozen=True, kw_only=True)
class Sample:
    command: str
    fence: str  # the opening fence line (```, ```bash)
    indent: str  # a block inside a list item is indented: its marker, fences and lines alike
    first: int  # index in README's lines of the block's first line (after the fence)
    lines: tuple[str, ...]  # the block's lines, without the bash block's command and "# " prefixes

    @property
    def is_bash(self) -> bool:
        return self.fence == "```bash"


def samples(text: str) -> list[Sample]:
    """Every marked sample of the README ``text``."""
    lines, found = text.split("\n"), []
    for index, line in enumerate(lines):
        match = MARKER.match(line)
        if match is None:
            continue
        indent = match["indent"]
        fence = lines[index + 1].removeprefix(indent)
        assert fence.startswith("```"), f"README line {index + 2}: a sample marker must precede a fenced block"
        end = next(i for i in range(index + 2, len(lines)) if lines[i] == f"{indent}```")
        body = [line.removeprefix(indent) for line in lines[index + 2 : end]]
        if fence == "```bash":
            assert body and body[0] == match["command"], f"README line {index + 3}: the block runs another command"
            body = [entry.removeprefix("# ").removeprefix("#") for entry in body[1:]]
        found.append(Sample(command=match["command"], fence=fence, indent=indent, first=index + 2, lines=tuple(body)))
    return found


def relative(line: str, *, places: tuple[Path, ...]) -> str:
    """``line`` with the paths under ``places`` made relative to them."""
    for place in places:
        line = line.replace(f"{place}/", "")
    return line


def comparable(line: str) -> str:
    """``line`` with the planner's own wall time (the ``search:`` line's seconds) left out."""
    return SEARCH_SECONDS.sub("X s", line) if line.startswith("search: ") else line


def run_command(command: str, scratch: Path) -> list[str]:
    """What ``command`` prints (stdout, or stderr when it fails), run in-process in ``scratch``, paths relative."""
    from planner.cli.main import main

    args = shlex.split(command)
    assert args[0] == "plan", command
    assert "local-cpu" not in args or "--no-calibrate" in args, f"{command}: a local-cpu sample needs --no-calibrate"
    out, err, before = io.StringIO(), io.StringIO(), Path.cwd()
    try:
        os.chdir(scratch)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args[1:])
    finally:
        os.chdir(before)
    text = out.getvalue() if code == 0 else err.getvalue()
    places = (scratch.resolve(), scratch, ROOT)
    return [relative(line, places=places) for line in text.rstrip("\n").split("\n")]


@contextlib.contextmanager
def scratch_directory():
    """A directory to run the samples in, ``examples`` linked in, with an empty autoplan cache."""
    saved = os.environ.get("AUTOPLAN_CACHE_DIR")
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        (scratch / "examples").symlink_to(ROOT / "examples")
        os.environ["AUTOPLAN_CACHE_DIR"] = str(scratch / "cache")
        try:
            yield scratch
        finally:
            if saved is None:
                os.environ.pop("AUTOPLAN_CACHE_DIR", None)
            else:
                os.environ["AUTOPLAN_CACHE_DIR"] = saved


def expected_and_got(sample: Sample, output: list[str]) -> tuple[list[str], list[str]]:
    """The block's lines and the output's lines they stand for (around the one elision, if any)."""
    block = list(sample.lines)
    if ELISION not in block:
        return block, output
    cut = block.index(ELISION)
    head, tail = block[:cut], block[cut + 1 :]
    if len(output) < len(head) + len(tail):
        return block, output
    return head + tail, output[: len(head)] + (output[len(output) - len(tail) :] if tail else [])


def refreshed(sample: Sample, output: list[str]) -> list[str]:
    """The block's new lines: the output, or its first and last lines around the block's elision."""
    block = list(sample.lines)
    lines = output
    if ELISION in block:
        cut = block.index(ELISION)
        head, tail = len(block[:cut]), len(block[cut + 1 :])
        lines = [*output[:head], ELISION, *(output[len(output) - tail :] if tail else [])]
    if sample.is_bash:
        lines = [sample.command, *(f"# {line}" if line else "#" for line in lines)]
    return [f"{sample.indent}{line}" if line else line for line in lines]


SAMPLES = samples(README.read_text())


@pytest.fixture(scope="module")
def scratch():
    with scratch_directory() as directory:
        yield directory


def test_the_readme_has_samples() -> None:
    assert len(SAMPLES) >= 3
    assert any("dgx-a100" in sample.command for sample in SAMPLES)


TOY_README = """intro
<!-- sample: plan a.py --batch-size 2 -->
```
line 1
...
last
```
- item:

  <!-- sample: plan b.py -->
  ```bash
  plan b.py
  # search: 1.00 s (capture 0.50 s)
  # done
  ```
"""


def test_samples_are_read_with_their_elision_indentation_and_bash_prompts() -> None:
    first, second = samples(TOY_README)
    assert (first.command, first.lines, first.is_bash) == ("plan a.py --batch-size 2", ("line 1", "...", "last"), False)
    assert (second.command, second.indent, second.is_bash) == ("plan b.py", "  ", True)
    assert second.lines == ("search: 1.00 s (capture 0.50 s)", "done")
    # the elision stands for any lines between; a changed first or last line is a drift
    assert expected_and_got(first, ["line 1", "x", "y", "last"]) == (["line 1", "last"], ["line 1", "last"])
    expected, got = expected_and_got(first, ["line 1", "x", "changed"])
    assert expected != got
    # the search's seconds are left out, and nothing else
    output = ["search: 2.71 s (capture 0.93 s)", "done"]
    assert list(map(comparable, second.lines)) == list(map(comparable, output))
    assert list(map(comparable, second.lines)) != list(map(comparable, ["search: 2.71 s (capture 0.93 s)", "Done"]))
    # --update writes the output back in the block's own form, elision kept
    assert refreshed(first, ["line 1", "a", "b", "end"]) == ["line 1", "...", "end"]
    assert refreshed(second, output) == ["  plan b.py", "  # search: 2.71 s (capture 0.93 s)", "  # done"]


@pytest.mark.parametrize(
    "sample",
    [
        pytest.param(sample, marks=[pytest.mark.slow] if any(s in sample.command for s in SLOW_SAMPLES) else [])
        for sample in SAMPLES
    ],
    ids=[sample.command for sample in SAMPLES],
)
def test_a_readme_sample_is_what_its_command_prints(sample: Sample, scratch: Path) -> None:
    expected, got = expected_and_got(sample, run_command(sample.command, scratch))
    assert list(map(comparable, got)) == list(map(comparable, expected)), (
        f"README.md's sample of `{sample.command}` (line {sample.first}) drifted: "
        "run `python -m tests.test_readme_samples --update`"
    )


def update(path: Path = README) -> int:
    """Rewrite every marked block of ``path`` whose command prints something else now (its search seconds aside);
    the number of blocks rewritten."""
    lines = path.read_text().split("\n")
    changed = 0
    with scratch_directory() as scratch:
        for sample in reversed(samples("\n".join(lines))):  # bottom up: earlier indices stay valid
            body = refreshed(sample, run_command(sample.command, scratch))
            end = sample.first + (len(sample.lines) + (1 if sample.is_bash else 0))
            if list(map(comparable, lines[sample.first : end])) != list(map(comparable, body)):  # else keep it
                lines[sample.first : end] = body
                changed += 1
    path.write_text("\n".join(lines))
    return changed


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.test_readme_samples --update")
    print(f"README.md: {update()} sample(s) rewritten")
