"""Writes the site's generated pages: docs/reference/config.md (every config key: type, default,
the comment that documents it in the config dataclasses), docs/reference/cli.md (every `jaxrl`
command's options, from its argument parser), and docs/index.md and docs/changelog.md (the
README and CHANGELOG.md, their links made relative to docs/). `make docs` runs it before
`mkdocs build`; tests/test_docs.py checks that the committed pages are what it writes and that
every config key has a comment.

    python docs/gen_reference.py            # write the pages
    python docs/gen_reference.py --check    # exit 1 if a page is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxrl import cli  # noqa: E402
from jaxrl.config import RunConfig  # noqa: E402

PAGES = {"config": ROOT / "docs/reference/config.md", "cli": ROOT / "docs/reference/cli.md",
         "index": ROOT / "docs/index.md", "changelog": ROOT / "docs/changelog.md"}
GENERATED = "<!-- Generated from {source} by docs/gen_reference.py (make docs); do not edit. -->\n\n"


def copied_page(source: str) -> str:
    """README.md or CHANGELOG.md as a page of the site: links into docs/ made relative to it."""
    text = (ROOT / source).read_text()
    text = text.replace("](docs/", "](").replace("](CHANGELOG.md)", "](changelog.md)")
    text = text.replace("(docs/benchmarks.md)", "(benchmarks.md)")
    return GENERATED.format(source=source) + text


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation from the class's source: the comment lines right above it
    and the comment at the end of its line (with the comment-only lines under it whose words
    start in the same column)."""
    lines, _ = inspect.getsourcelines(cls)
    comments: dict[int, tuple[int, str]] = {}          # line -> (column, text)
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#")
            column = tok.start[1] + len(tok.string) - len(text.lstrip())   # where the words start
            comments[tok.start[0]] = (column, text.strip())
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    docs, previous = {}, None         # (line, doc) of the field just above
    for f in dataclasses.fields(cls):
        pattern = re.compile(rf"^\s+{f.name}\s*:")
        found = [i + 1 for i, line in enumerate(lines) if pattern.match(line)]
        if not found:
            continue
        n = found[0]
        above, k = [], n - 1
        while k in comments and k not in code_lines:
            above.insert(0, comments[k][1])
            k -= 1
        after = []
        if n in comments:
            column, text = comments[n]
            after.append(text)
            k = n + 1
            while k in comments and k not in code_lines and comments[k][0] == column:
                after.append(comments[k][1])
                k += 1
        doc = " ".join(t for t in above + after if t)
        # A field with no comment of its own, right under one documented by a comment block
        # above it (no blank line between), shares that block: it documents the group.
        if not doc and previous and previous[1] and _run_of_fields(lines, previous[0], n):
            docs[f.name] = f"See `{previous[2]}` above."
            previous = (n, previous[1], previous[2])
            continue
        docs[f.name] = doc
        previous = (n, doc, f.name) if above and not after else None
    return docs


def _run_of_fields(lines: list[str], start: int, end: int) -> bool:
    """Lines start..end (1-based) are consecutive field lines, none blank."""
    return all(re.match(r"^\s+\w+\s*:", lines[k - 1]) for k in range(start, end + 1))


def _is_section(tp) -> bool:
    """A dataclass, or a union of dataclasses (None allowed): a section of its own."""
    members = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return all(dataclasses.is_dataclass(a) for a in members)


def _type_name(tp) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "").replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{value!r}`".replace("|", "\\|")


def sections(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, type]]:
    """(key prefix, dataclass) of every section, depth first; a union (the task) gives one
    section per member, named by its `name`."""
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        members = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            members = [tp]
        for member in members:
            out += sections(member, f"{prefix}{f.name}.")
    return out


def undocumented() -> list[str]:
    """Config keys with no comment."""
    missing = []
    for prefix, cls in sections():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if _is_section(hints[f.name]) or not f.init:
                continue
            if not docs.get(f.name):
                missing.append(f"{prefix}{f.name} ({cls.__qualname__}, "
                               f"{Path(inspect.getsourcefile(cls)).relative_to(ROOT)})")
    return missing


def config_page() -> str:
    out = ["# Configuration reference", "",
           "Generated from the config dataclasses by `docs/gen_reference.py` (`make docs`); "
           "do not edit. The dataclasses are the defaults, a YAML file in `configs/` overrides "
           "them, and `section.key=value` on the command line overrides the YAML. An unknown "
           "key, a value of the wrong type or a key given twice is an error that names it.", ""]
    for prefix, cls in sections():
        title = prefix.rstrip(".") or "top level"
        name = getattr(cls, "name", None) if prefix.startswith("task.") else None
        if isinstance(getattr(cls, "name", None), str) and prefix == "task.":
            title = f"task (task.name={cls.name})"
        out += [f"## `{title}`" if prefix else "## Top level", ""]
        doc = inspect.getdoc(cls)
        if doc:
            out += [doc.split("\n\n")[0].replace("\n", " "), ""]
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        rows = []
        for f in dataclasses.fields(cls):
            if not f.init or _is_section(hints[f.name]):
                continue
            text = re.sub(r"^See `(\w+)` above", rf"See `{prefix}\1` above",
                          docs.get(f.name, "")).replace("|", "\\|")
            rows.append(f"| `{prefix}{f.name}` | {_type_name(f.type)} | {_default(f)} | {text} |")
        if rows:
            out += ["| key | type | default | what it does |", "|---|---|---|---|", *rows, ""]
        del name
    return "\n".join(out).rstrip() + "\n"


def cli_page() -> str:
    parser = cli.build_parser()
    out = ["# Command-line reference", "",
           "Generated from `jaxrl`'s argument parser by `docs/gen_reference.py` (`make docs`); "
           "do not edit. `jaxrl COMMAND --help` prints the same.", ""]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        sub.prog = f"jaxrl {name}"
        sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        out += [f"## `jaxrl {name}`", "", "```", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    args = p.parse_args(argv)
    stale = []
    pages = {"config": config_page(), "cli": cli_page(), "index": copied_page("README.md"),
             "changelog": copied_page("CHANGELOG.md")}
    for key, text in pages.items():
        path = PAGES[key]
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date (run `make docs`): {', '.join(stale)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
