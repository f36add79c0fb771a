"""The documentation holds together: a short README that opens with the two commands, links that lead
somewhere, and a configuration reference in step with ChannelConfig. Fast, no network."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 150
#: the two commands must be on the README's first lines, before anything else a reader would scroll past
README_HEAD_LINES = 6

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> List[Path]:
    return [README] + sorted(DOCS.glob("*.md"))


def _prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, punctuation other than
    hyphens and underscores dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 ... for repeated headings."""
    seen: Dict[str, int] = {}
    out: Set[str] = set()
    for _, line in _prose_lines(path.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        if slug in seen:
            seen[slug] += 1
            out.add(f"{slug}-{seen[slug]}")
        else:
            seen[slug] = 0
            out.add(slug)
    return out


def relative_links(path: Path) -> Iterator[Tuple[int, str]]:
    """(line number, target) of every link in prose that is not a URL (code spans and blocks left out)."""
    for n, line in _prose_lines(path.read_text()):
        prose = _INLINE_CODE.sub("code", line)
        for m in _LINK.finditer(prose):
            target = m.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            yield n, target


def test_github_slug_matches_github() -> None:
    assert github_slug("FATE-Flow 2.2") == "fate-flow-22"
    assert github_slug("Certificates: `fate-rdma tls init`") == "certificates-fate-rdma-tls-init"
    assert github_slug("chunk_bytes") == "chunk_bytes"
    assert github_slug("1. Chunk size x transport on one link (the paper's Table 2, scaled)") == \
        "1-chunk-size-x-transport-on-one-link-the-papers-table-2-scaled"


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    head = "\n".join(lines[:README_HEAD_LINES])
    assert "make demo" in head and "make test" in head, \
        f"README.md's first {README_HEAD_LINES} lines must hold `make demo` and `make test`"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for n, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"line {n}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"line {n}: {target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def _generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "tools" / "gen_config_doc.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_configuration_reference_is_in_sync_with_channel_config() -> None:
    gen = _generator()
    assert gen.check(), "docs/configuration.md is stale: run `python tools/gen_config_doc.py`"


def test_every_channel_config_field_is_in_the_reference() -> None:
    from fate_rdma.config import ChannelConfig

    headings = anchors(DOCS / "configuration.md")
    missing = [f.name for f in dataclasses.fields(ChannelConfig) if f.name not in headings]
    assert not missing, f"docs/configuration.md lacks {', '.join(missing)}"
