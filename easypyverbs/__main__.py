"""`python -m easypyverbs doctor [--json]`."""
from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "doctor":
        print("usage: python -m easypyverbs doctor [--json]\n\n"
              "Lists verbs providers, RDMA devices, ports, GIDs, MTU, max_msg_sz, and what provider=auto picks.\n"
              "Exit code 0 when a usable provider exists.")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from .doctor import main as doctor

    return doctor(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
