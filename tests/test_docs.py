"""The documentation: a short README whose quick start runs, a site that builds strictly, and
generated reference pages that are current and document every config key."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.xla import xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import gen_reference  # noqa: E402


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"


# Words about how the work on the project was organised rather than about the project.
_DIARY = re.compile(r"\bsessions? (of|[0-9])|\bthis session\b|\bissues? #?[0-9]+\b|\bgoals?\b|"
                    r"\bworkplace\b|\bdevice time\b|\bwork periods?\b|\bnotes? reports?\b|"
                    r"\b(?:was|were|is|are) lent\b",
                    re.IGNORECASE)


def test_the_docs_speak_of_the_project_not_of_how_it_was_built():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(ROOT)}:{i}: {m.group(0)!r}" for page in pages
             for i, line in enumerate(page.read_text().splitlines(), 1)
             for m in _DIARY.finditer(line)]
    assert not found, "\n".join(found)


def test_the_benchmarks_page_is_a_results_page():
    """No dated heading (each benchmark's current table, its date in the table or text), and a
    headline table that fits one screen."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    dated = [h for h in lines if h.startswith("#") and re.search(r"\b20\d\d-\d\d-\d\d\b", h)]
    assert not dated, dated
    start = lines.index("## Headline")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    assert end - start <= 30, f"the headline section has {end - start} lines"


def test_every_config_key_is_documented():
    assert gen_reference.undocumented() == [], (
        "config keys without a comment in their dataclass (write one above the field or at the "
        "end of its line)")


def test_a_key_without_a_comment_is_found(tmp_path):
    """The checker itself: a field with no comment has no doc; a comment block above a run of
    fields documents the first and is pointed to by the others."""
    import dataclasses
    import importlib.util

    (tmp_path / "cfg_sample.py").write_text(
        "import dataclasses\n\n\n@dataclasses.dataclass\nclass C:\n"
        "    a: int = 1          # the first\n"
        "    b: int = 2\n\n"
        "    # both of these\n"
        "    c: int = 3\n"
        "    d: int = 4\n")
    spec = importlib.util.spec_from_file_location("cfg_sample", tmp_path / "cfg_sample.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cfg_sample"] = module
    spec.loader.exec_module(module)
    docs = gen_reference.field_docs(module.C)
    assert dataclasses.is_dataclass(module.C)
    assert docs == {"a": "the first", "b": "", "c": "both of these", "d": "See `c` above."}


def test_the_generated_pages_are_current():
    assert gen_reference.main(["--check"]) == 0, "run `make docs` and commit the pages"


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```\n(.*?)```", text, re.S)
    assert block, "README.md has no quick-start code block"
    return block.group(1).strip().splitlines()


@pytest.mark.slow
def test_the_quick_start_runs(tmp_path):
    """The README's two commands are the Makefile's targets; `make run`'s command (the demo)
    runs to its summary, shortened by overrides; `make test`'s runs both tiers."""
    assert quick_start() == ["make run", "make test"]
    recipes = {}
    for target in ("run", "test"):
        done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        recipes[target] = done.stdout
    assert "-m \"not gpu and not multi_device and not learning\"" in recipes["test"]
    assert "-m \"not gpu and multi_device and not learning\"" in recipes["test"]
    [demo] = [line for line in recipes["run"].splitlines() if "jaxrl train" in line]
    args = shlex.split(demo)
    env = {**os.environ, **dict(a.split("=", 1) for a in args if "=" in a and "/" not in a
                                and a.split("=")[0].isupper())}
    command = [a for a in args if not (a.split("=")[0].isupper() and "=" in a)]
    command[0] = str(ROOT / command[0])       # .venv/bin/jaxrl
    # Shortened as colab/quickstart.ipynb's short mode is (tests/colab), on one device with the
    # suite's compile flags: the programs are the notebook's, which the suite runs first, so
    # this run loads them from the suite's compilation cache instead of compiling them again.
    short = ["train.steps=4", "train.eval_problems=16", "train.log_every=2", "rl.steps=2",
             f"run_dir={tmp_path / 'demo'}"]
    done = subprocess.run(command + short, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**env, "XLA_FLAGS": xla_flags(1)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "demo" / "metrics.jsonl").is_file()
    assert "held-out" in (done.stdout + done.stderr).lower(), done.stdout[-3000:]
