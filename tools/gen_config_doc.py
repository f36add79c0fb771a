#!/usr/bin/env python3
"""Write docs/configuration.md, the channel configuration reference, from `fate_rdma.config.ChannelConfig`.

    python tools/gen_config_doc.py            # (re)write docs/configuration.md
    python tools/gen_config_doc.py --check    # exit 1 if docs/configuration.md is not what this would write

Every field of ChannelConfig, in declaration order, with its type and default taken from the dataclass and its
description taken from the source, looked up in this order:

1. the `#:` comment lines directly above the field in fate_rdma/config.py (the Sphinx convention);
2. the `#:` block above the run of fields the field belongs to, where that block names the field;
3. conf/channel.yaml: the comment on the key's own line, else the comment lines directly above the key;
4. conf/channel.yaml: the comment block above the run of keys the key belongs to, where it names the key.

A field found in none of them is listed as undocumented (and named on stderr), so that the fix is in the
code, not here. Never edit docs/configuration.md by hand: edit the comments and run this again.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PY = ROOT / "fate_rdma" / "config.py"
CHANNEL_YAML = ROOT / "conf" / "channel.yaml"
OUT = ROOT / "docs" / "configuration.md"

if str(ROOT) not in sys.path:  # run as a script from anywhere: import this checkout's fate_rdma
    sys.path.insert(0, str(ROOT))

_FIELD = re.compile(r"^\s+([A-Za-z_]\w*)\s*:\s*[^=]+=")  # `    name: type = default` inside the class
_KEY = re.compile(r"^\s+([A-Za-z_]\w*)\s*:(.*)$")  # `  key: value   # comment` inside `channel:`


@dataclasses.dataclass
class _Run:
    """Consecutive fields (or keys) with the comment block above the first of them."""

    block: str
    names: List[str]


def _names_field(block: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", block) is not None


def _comment_runs(text: str, opener: str, comment: str, entry: "re.Pattern[str]", inline: bool,
                  stop: Tuple[str, ...] = ()) -> Tuple[Dict[str, str], List[_Run]]:
    """The comment of each entry of the indented block after the line starting `opener`, and the runs of entries
    sharing one comment block. `comment`: what starts a comment line; `entry`: an entry's line (group 1 its name,
    group 2, if `inline`, the rest, whose ` # ...` is the entry's own comment); `stop`: lines that end the block."""
    own: Dict[str, str] = {}
    runs: List[_Run] = []
    block: List[str] = []
    run: Optional[_Run] = None
    inside = False
    for line in text.splitlines():
        if line.startswith(opener):
            inside = True
            continue
        if not inside:
            continue
        stripped = line.strip()
        if (stripped and not line[0].isspace()) or (stop and stripped.startswith(stop)):
            break  # the block ended (or, in a class, its methods begin: no more fields)
        if stripped.startswith(comment):
            block.append(stripped[len(comment):].lstrip("#").strip())
            run = None
            continue
        m = entry.match(line)
        if m:
            name = m.group(1)
            mine = m.group(2).split(" #", 1)[1].strip() if inline and " #" in m.group(2) else ""
            if mine or block:
                own[name] = mine or " ".join(block)
            if block:
                run = _Run(" ".join(block), [name])
                runs.append(run)
            elif run is not None:
                run.names.append(name)
            block = []
            continue
        block, run = [], None  # a blank line or anything else ends a comment block and a run
    return own, runs


def config_py_docs(text: str) -> Tuple[Dict[str, str], List[_Run]]:
    """The `#:` comment of each field of `class ChannelConfig` in `text`, and the runs of fields."""
    return _comment_runs(text, "class ChannelConfig", "#:", _FIELD, inline=False, stop=("def ", "@"))


def channel_yaml_docs(text: str) -> Tuple[Dict[str, str], List[_Run]]:
    """The comment of each key of the `channel:` section of conf/channel.yaml, and the runs of keys."""
    return _comment_runs(text, "channel:", "#", _KEY, inline=True)


def _from_runs(runs: Sequence[_Run], name: str) -> Optional[str]:
    for r in runs:
        if name in r.names and _names_field(r.block, name):
            return r.block
    return None


def describe(name: str, py: Tuple[Dict[str, str], List[_Run]], yml: Tuple[Dict[str, str], List[_Run]]
             ) -> Tuple[Optional[str], str]:
    """(description, where it was found) for field `name`."""
    if name in py[0]:
        return py[0][name], "fate_rdma/config.py"
    found = _from_runs(py[1], name)
    if found:
        return found, "fate_rdma/config.py"
    if name in yml[0]:
        return yml[0][name], "conf/channel.yaml"
    found = _from_runs(yml[1], name)
    if found:
        return found, "conf/channel.yaml"
    return None, ""


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return ""


def render_default(value: object) -> str:
    """A default as it is written in YAML, with a readable size beside byte counts."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int):
        size = _size(value)
        return f"`{value}` ({size})" if size and value >= 1024 else f"`{value}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _slug(name: str) -> str:
    return name.lower()


def _type_name(t: object) -> str:
    """A field's annotation as written (a string under `from __future__ import annotations`)."""
    return t if isinstance(t, str) else getattr(t, "__name__", repr(t))


def render() -> str:
    """The text of docs/configuration.md for this checkout."""
    from fate_rdma.config import ChannelConfig
    from fate_rdma.federation.site_policy import SITE_ONLY_KEYS, TIGHTEN_ONLY_KEYS

    py = config_py_docs(CONFIG_PY.read_text())
    yml = channel_yaml_docs(CHANNEL_YAML.read_text())
    fields = dataclasses.fields(ChannelConfig)
    out: List[str] = [
        "<!-- GENERATED by tools/gen_config_doc.py from fate_rdma/config.py and conf/channel.yaml: do not edit;",
        "     edit the comments there and run `python tools/gen_config_doc.py` (tests/test_docs.py checks it). -->",
        "# Channel configuration reference",
        "",
        "Every setting of the channel (`fate_rdma.config.ChannelConfig`): its type, its default and what it does.",
        "Every key is optional. The same keys go in",
        "",
        "- the `channel:` section of a channel file (`conf/channel.yaml` lists every key at its default;",
        "  `ChannelConfig.from_yaml(path)`, `fate-rdma doctor --config FILE`);",
        "- the `fate_rdma:` section of a launcher conf (`conf/fate_rdma_launcher.yaml`, `fate-rdma launch --conf`),",
        "  beside the FATE integration's own keys ([fate.md](fate.md));",
        "- a FATE-Flow job's `dag.conf.extra.fate_rdma` section, except the keys marked *site only*, which only the",
        "  site file written by `fate-rdma flow setup` may set ([operations.md](operations.md)). A job may set a",
        "  key marked *tighten only* stricter than the site file, never looser",
        "  ([security.md](security.md#the-sites-policy)); so may a launcher job's conf where its machine has a",
        "  site file.",
        "",
        "An inconsistent value is refused when the configuration is built (`ConfigError` naming the key).",
        "",
        "| key | type | default | |",
        "|---|---|---|---|",
    ]
    for f in fields:
        site = "site only" if f.name in SITE_ONLY_KEYS else "tighten only" if f.name in TIGHTEN_ONLY_KEYS else ""
        default = render_default(f.default)
        out.append(f"| [`{f.name}`](#{_slug(f.name)}) | `{_type_name(f.type)}` | {default} | {site} |")
    out.append("")
    missing = []
    for f in fields:
        text, source = describe(f.name, py, yml)
        out.append(f"## {f.name}")
        out.append("")
        line = f"Type `{_type_name(f.type)}`, default {render_default(f.default)}."
        if f.name in SITE_ONLY_KEYS:
            line += " Site only: a job section may not set it."
        elif f.name in TIGHTEN_ONLY_KEYS:
            line += " Tighten only: a job may make it stricter than the site's, never looser."
        out.append(line)
        out.append("")
        if text:
            out.append(f"{text} *({source})*")
        else:
            missing.append(f.name)
            out.append("*Not described in `fate_rdma/config.py` or `conf/channel.yaml`.*")
        out.append("")
    if missing:
        print(f"gen_config_doc: no description for {', '.join(missing)} (add a `#:` comment in fate_rdma/config.py)",
              file=sys.stderr)
    return "\n".join(out).rstrip("\n") + "\n"


def check(path: Path = OUT) -> bool:
    """Is `path` what render() writes?"""
    try:
        return path.read_text() == render()
    except FileNotFoundError:
        return False


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale, change nothing")
    args = p.parse_args(argv)
    if args.check:
        if check():
            return 0
        print(f"{OUT.relative_to(ROOT)} is stale: run `python tools/gen_config_doc.py`", file=sys.stderr)
        return 1
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
