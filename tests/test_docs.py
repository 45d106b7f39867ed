"""The documentation is part of what ships: the site builds with warnings as errors, every
python block of the README and the user pages runs as written, the examples run (the linen
one killed and resumed bitwise), and the user pages carry no development notes.

Convention for the pages: a ```` ```python ```` block runs (the blocks of one page in order,
in one fresh process, from an empty directory); a ```` ```py ```` block is a fragment shown
for reading only. A block whose first line is ``# examples/NAME.py`` is that file, shown
whole: it must equal the file, and runs as the file does (`test_examples`).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# the pages whose python blocks run; the "how it works" pages show internals, not runnable code
USER_PAGES = ["README.md", "docs/index.md", "docs/concepts.md", "docs/train-step.md", "docs/troubleshooting.md",
              "docs/faq.md", *sorted(str(p.relative_to(ROOT)) for p in (DOCS / "guides").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    return _BLOCK.findall((ROOT / page).read_text())


def _run(args, cwd, timeout=300, env=None):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tools come with the [test] extra")
    r = _run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")], cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "api" / "resilax" / "index.html").exists()


def test_api_reference_names_every_public_name():
    import resilax
    import resilax.launched

    ref = (DOCS / "api" / "resilax.md").read_text()
    missing = [n for n in resilax.__all__ if n != "launched" and f"::: resilax.{n}\n" not in ref]
    assert not missing, f"docs/api/resilax.md lacks {missing}"
    ref = (DOCS / "api" / "launched.md").read_text()
    missing = [n for n in resilax.launched.__all__ if f"::: resilax.launched.{n}\n" not in ref]
    assert not missing, f"docs/api/launched.md lacks {missing}"


def test_user_pages_carry_no_development_notes():
    pages = ["README.md", *(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))]
    bad = re.compile(r"issue [0-9]|20[0-9]{2}-[0-9]{2}-[0-9]{2}")
    hits = [f"{p}:{i}: {line.strip()}" for p in pages
            for i, line in enumerate((ROOT / p).read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, "dates or issue numbers in user docs (they belong in benchmarks/NOTES.md):\n" + "\n".join(hits)


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    assert "pip install -q -e . && resilax demo" in text
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = re.search(r"^python3 -m venv .* tests$", text, re.M)
    assert test_cmd, "the README's test command"
    # .ci/run runs the README's command (split over lines, with the versions printed between)
    for part in ("pip install -q --no-compile -e '.[test]'", "python -m pytest -q -n 3 --dist worksteal --durations=15 tests"):
        assert part in test_cmd.group(0) and part in ci


@pytest.mark.parametrize("page", [p for p in USER_PAGES if python_blocks(p)])
def test_page_code_runs(page, tmp_path):
    """Every python block of the page, in order, in one fresh process."""
    blocks = []
    for b in python_blocks(page):
        first = b.splitlines()[0] if b.strip() else ""
        m = re.fullmatch(r"# (examples/\w+\.py)", first)
        if m:  # the whole example file, shown: it must be the file (which test_examples runs)
            assert b == (ROOT / m.group(1)).read_text(), f"{page}: its copy of {m.group(1)} differs from the file"
            continue
        blocks.append(b)
    if not blocks:
        return
    script = tmp_path / "page.py"
    script.write_text("\n".join(blocks))
    r = _run([sys.executable, str(script)], cwd=tmp_path)
    assert r.returncode == 0, f"{page}'s code failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def _digest(out: str) -> str:
    m = re.search(r"^params digest (\w+)$", out, re.M)
    assert m, out
    return m.group(1)


def test_linen_example_killed_and_resumed_bitwise(tmp_path):
    """examples/train_linen.py as its docstring says: SIGKILLed, run again, the same bits."""
    ex = str(ROOT / "examples" / "train_linen.py")
    ref = _run([sys.executable, ex, "--steps", "20", "--checkpoint-dir", str(tmp_path / "ref")], cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-4000:]
    killed = _run([sys.executable, ex, "--steps", "20", "--checkpoint-dir", str(tmp_path / "ck"), "--kill-at", "13"],
                  cwd=tmp_path)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-4000:])
    resumed = _run([sys.executable, ex, "--steps", "20", "--checkpoint-dir", str(tmp_path / "ck")], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    # the record log's disk entries may trail the step by LogConfig.max_lag (2) when the kill lands
    at = re.search(r"resumed at step (\d+)", resumed.stdout)
    assert at and 13 - 2 <= int(at.group(1)) <= 13, resumed.stdout
    assert _digest(resumed.stdout) == _digest(ref.stdout)


def test_nnx_example_runs(tmp_path):
    r = _run([sys.executable, str(ROOT / "examples" / "train_nnx.py"), "--steps", "12", "--checkpoint-dir",
              str(tmp_path / "ck")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "step 10: loss" in r.stdout and _digest(r.stdout)
