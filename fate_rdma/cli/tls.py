"""`fate-rdma tls init DIR --parties guest:9999 host:10000 arbiter:10000`: a federation CA and one
certificate and key per party, made with the `openssl` command line tool.

Each party's certificate names it (subject commonName and a URI SAN "fate-rdma:<party>"), which is what
an endpoint with `tls: true` checks: a peer must present a certificate from the federation's CA that
names the party it claims to be (the one the dialer dialed). `A+B` gives one certificate naming both
parties, for a site that runs both. Keys are EC P-256, mode 600. Run again on the same DIR to issue
certificates for more parties from the same CA (ca.key stays in DIR: keep DIR with the operator, copy
to each site only its own .pem and .key and ca.pem). Exit codes: 0 ok, 1 openssl failed, 2 bad usage.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Sequence

#: about two years and three months: the longest lifetime common TLS clients accept for a leaf certificate
DAYS = 825
CA_DAYS = 3650
CA_SUBJECT = "/O=fate-rdma/CN=fate-rdma federation CA"
_NAME = re.compile(r"^[A-Za-z0-9_.@-]+(:[A-Za-z0-9_.@-]+)?$")  # role:party_id; nothing openssl reads as syntax


@dataclasses.dataclass(frozen=True)
class PartyFiles:
    names: List[str]  # the parties the certificate names (one, or a site's several)
    cert: str
    key: str
    ca: str


def _openssl(args: Sequence[str]) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command line tool is not installed (apt-get install openssl)")
    r = subprocess.run([exe, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {r.stderr.strip()[-500:]}")


def _file_stem(names: List[str]) -> str:
    return "+".join(names).replace(":", "_")


def make_certificates(folder: str, parties: Sequence[str], days: int = DAYS, force: bool = False) -> Dict[str, PartyFiles]:
    """A CA in `folder` (made once, reused after) and a certificate and key per entry of `parties`
    ("role:party_id", or "A+B" for one certificate naming both). Returns party -> its files. Refuses
    (FileExistsError) to replace a party's files unless `force`; ValueError for a malformed name."""
    groups = [p.split("+") for p in parties]
    for names in groups:
        bad = [n for n in names if not _NAME.match(n) or len(n) > 64]
        if bad:
            raise ValueError(f"bad party name {bad[0]!r}: want role:party_id, e.g. guest:9999 (letters, digits, _.@-)")
    os.makedirs(folder, exist_ok=True)
    ca, ca_key = os.path.join(folder, "ca.pem"), os.path.join(folder, "ca.key")
    targets = [(names, os.path.join(folder, _file_stem(names))) for names in groups]
    if not force:
        for _, stem in targets:
            if os.path.exists(stem + ".pem") or os.path.exists(stem + ".key"):
                raise FileExistsError(f"{stem}.pem exists; pass --force to issue it again")
    if not (os.path.exists(ca) and os.path.exists(ca_key)):
        _openssl(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", ca_key, "-out", ca, "-days", str(CA_DAYS), "-subj", CA_SUBJECT,
                  "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        os.chmod(ca_key, 0o600)
        os.chmod(ca, 0o644)
    out: Dict[str, PartyFiles] = {}
    with tempfile.TemporaryDirectory(prefix="fate-rdma-tls-") as tmp:
        for names, stem in targets:
            csr, ext = os.path.join(tmp, "req.csr"), os.path.join(tmp, "ext.cnf")
            with open(ext, "w") as f:
                f.write("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                        "extendedKeyUsage=serverAuth,clientAuth\n"
                        f"subjectAltName={','.join('URI:fate-rdma:' + n for n in names)}\n")
            _openssl(["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                      "-keyout", stem + ".key", "-out", csr, "-subj", f"/O=fate-rdma/CN={names[0]}"])
            os.chmod(stem + ".key", 0o600)
            _openssl(["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-set_serial",
                      "0x" + secrets.token_hex(16), "-days", str(days), "-extfile", ext, "-out", stem + ".pem"])
            os.chmod(stem + ".pem", 0o644)
            for n in names:
                out[n] = PartyFiles(names, stem + ".pem", stem + ".key", ca)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("example:\n  fate-rdma tls init ./federation-tls --parties guest:9999 host:10000 arbiter:10000\n"
                "then at each site: copy its PARTY.pem, PARTY.key (mode 600) and ca.pem there and run\n"
                "  fate-rdma flow setup --tls --tls-cert PARTY.pem --tls-key PARTY.key --tls-ca ca.pem ...\n"
                "exit codes: 0 ok, 1 openssl failed, 2 bad usage")
    sub = p.add_subparsers(dest="tls_action", metavar="ACTION", required=True)
    i = sub.add_parser("init", help="make a federation CA (once) and a certificate and key per party",
                       description=__doc__.split("\n\n")[0])
    i.add_argument("dir", help="folder for ca.pem, ca.key and PARTY.pem/PARTY.key (made if absent)")
    i.add_argument("--parties", nargs="+", required=True, metavar="ROLE:PARTY_ID",
                   help="the parties, e.g. guest:9999 host:10000; A+B = one certificate for a site running both")
    i.add_argument("--days", type=int, default=DAYS, help=f"validity of the party certificates (default {DAYS})")
    i.add_argument("--force", action="store_true", help="issue again a party whose files exist")


def run(args: argparse.Namespace) -> int:
    folder = os.path.abspath(args.dir)
    had_ca = os.path.exists(os.path.join(folder, "ca.key"))
    try:
        files = make_certificates(folder, args.parties, args.days, args.force)
    except (ValueError, FileExistsError) as exc:
        print(f"fate-rdma tls init: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"fate-rdma tls init: {exc}", file=sys.stderr)
        return 1
    ca = os.path.join(folder, "ca.pem")
    print(f"{'used the existing' if had_ca else 'made a'} federation CA in {folder}:")
    print(f"  {ca}       the CA certificate: every site gets a copy (tls_ca)")
    print(f"  {os.path.join(folder, 'ca.key')}       the CA key (mode 600): stays here, with the operator; it issues "
          f"party certificates (run this again with new --parties)")
    done = set()
    for party, f in files.items():
        if f.cert in done:
            continue
        done.add(f.cert)
        print(f"\nsite of {' and '.join(f.names)}: copy {os.path.basename(f.cert)}, {os.path.basename(f.key)} (keep it "
              f"mode 600) and ca.pem there over a channel you trust; its site file then says (paths as copied):")
        print(f"  tls: true\n  tls_cert: {f.cert}\n  tls_key: {f.key}\n  tls_ca: {f.ca}")
    print(f"\n`fate-rdma flow setup --tls --tls-cert PARTY.pem --tls-key PARTY.key --tls-ca ca.pem` writes these keys "
          f"into a site file. Certificates valid {args.days} days; each names its party (CN and URI SAN "
          f"fate-rdma:PARTY), which is what a peer checks.")
    return 0
