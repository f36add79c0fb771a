"""`fate-rdma secret FILE`: write a fresh federation secret (256 bits, hex, mode 600).

Every site of a federation puts the same secret in its site file (`secret_file:`); endpoints then
prove it to each other before anything is allocated (HMAC-SHA256 challenge-response). Copy it to
the other sites over a channel you trust (scp, a secret manager), never in a job conf.
"""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="where to write the secret (refused if it exists, unless --force)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    from ..channel.auth import load_secret, write_secret

    if os.path.exists(args.file) and not args.force:
        print(f"fate-rdma secret: {args.file} exists; pass --force to replace it (every site must then get the new "
              f"one)", file=sys.stderr)
        return 2
    write_secret(args.file)
    load_secret(args.file)  # check it as an endpoint will read it
    print(f"wrote a 256-bit secret to {args.file} (mode 600); give every site of the federation the same file "
          f"and set secret_file: {os.path.abspath(args.file)} in its site configuration")
    return 0
