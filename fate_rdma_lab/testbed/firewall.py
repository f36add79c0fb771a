"""nftables in a site's namespace, as the fault studies and the site tests use it: one input chain that does what
a rule says to the packets it matches (drop them, answer them with TCP resets, count them)."""
from __future__ import annotations

import shutil
import subprocess
from typing import Optional

from .bed import in_ns, namespace_problem


def problem() -> Optional[str]:
    """Why site firewalls cannot be set here (no namespaces, no nft), or None."""
    return namespace_problem() or (None if shutil.which("nft") else "nft (nftables) is not installed")


def site_rule(ns: str, table: str, rule: Optional[str]) -> None:
    """Table `table` in namespace `ns`: an input chain holding `rule` (a whole nft rule, e.g. `ip saddr
    198.18.1.2 drop`); a falsy `rule` removes the table."""
    subprocess.run(in_ns(ns, ["nft", "delete", "table", "inet", table]), capture_output=True)
    if rule:
        script = (f"table inet {table} {{\n  chain input {{\n    type filter hook input priority filter; policy "
                  f"accept;\n    {rule}\n  }}\n}}\n")
        subprocess.run(in_ns(ns, ["nft", "-f", "-"]), input=script, text=True, check=True, capture_output=True)
