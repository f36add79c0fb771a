"""The parties' TLS certificates (tls: true), made with the `openssl` command line tool, two ways:

    fate-rdma tls request SITE_DIR --party guest:9999       (at the site: its key and a request)
    fate-rdma tls sign CA_DIR guest_9999.csr --party guest:9999   (at the federation's CA: the certificate)

so that no private key leaves its site: the site sends its .csr to the CA's operator and gets back its .pem
and ca.pem (the CA is made at the first sign, in CA_DIR). Or, for a lab or one operator running every site:

    fate-rdma tls init DIR --parties guest:9999 host:10000 arbiter:10000

a federation CA and one certificate and key per party in one folder.

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
from typing import Dict, List, Sequence, Tuple

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


def _check_names(names: Sequence[str]) -> None:
    bad = [n for n in names if not _NAME.match(n) or len(n) > 64]
    if bad:
        raise ValueError(f"bad party name {bad[0]!r}: want role:party_id, e.g. guest:9999 (letters, digits, _.@-)")


def _ensure_ca(folder: str) -> Tuple[str, str]:
    """The CA in `folder` (ca.pem, ca.key), made if absent."""
    os.makedirs(folder, exist_ok=True)
    ca, ca_key = os.path.join(folder, "ca.pem"), os.path.join(folder, "ca.key")
    if not (os.path.exists(ca) and os.path.exists(ca_key)):
        _openssl(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                  "-keyout", ca_key, "-out", ca, "-days", str(CA_DAYS), "-subj", CA_SUBJECT,
                  "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        os.chmod(ca_key, 0o600)
        os.chmod(ca, 0o644)
    return ca, ca_key


def _key_and_request(stem: str, names: Sequence[str], csr: str) -> None:
    """A new EC P-256 key at `stem`.key (mode 600) and a certificate request for `names` at `csr`."""
    _openssl(["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
              "-keyout", stem + ".key", "-out", csr, "-subj", f"/O=fate-rdma/CN={names[0]}"])
    os.chmod(stem + ".key", 0o600)


def _sign(ca: str, ca_key: str, csr: str, names: Sequence[str], days: int, out: str) -> None:
    """The CA's certificate for the key in request `csr`, naming `names` (CN the first, URI SAN each)."""
    with tempfile.TemporaryDirectory(prefix="fate-rdma-tls-") as tmp:
        ext = os.path.join(tmp, "ext.cnf")
        with open(ext, "w") as f:
            f.write("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                    "extendedKeyUsage=serverAuth,clientAuth\n"
                    f"subjectAltName={','.join('URI:fate-rdma:' + n for n in names)}\n")
        _openssl(["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-set_serial",
                  "0x" + secrets.token_hex(16), "-days", str(days), "-extfile", ext, "-out", out,
                  "-subj", f"/O=fate-rdma/CN={names[0]}"])
    os.chmod(out, 0o644)


def request_certificate(folder: str, parties: Sequence[str]) -> Tuple[str, str]:
    """At a site: a key (mode 600, it stays here) and a certificate request naming `parties` in `folder`;
    returns (key, request). FileExistsError if the key exists (it may already hold a certificate)."""
    _check_names(parties)
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, _file_stem(list(parties)))
    if os.path.exists(stem + ".key"):
        raise FileExistsError(f"{stem}.key exists: this site has its key already (remove it to make a new one)")
    _key_and_request(stem, parties, stem + ".csr")
    return stem + ".key", stem + ".csr"


def request_subject(csr: str) -> str:
    """The commonName a request asks for, once its signature checks (ValueError if it does not)."""
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command line tool is not installed (apt-get install openssl)")
    r = subprocess.run([exe, "req", "-in", csr, "-noout", "-verify", "-subject", "-nameopt", "multiline"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise ValueError(f"{csr} is not a valid certificate request: {(r.stderr or r.stdout).strip()[-300:]}")
    m = re.search(r"commonName\s*=\s*(\S+)", r.stdout)
    return m.group(1) if m else ""


def sign_request(ca_folder: str, csr: str, parties: Sequence[str], days: int = DAYS, out: str = "") -> str:
    """At the CA: the certificate for request `csr` naming `parties` (what the CA's operator vouches for, not
    what the request says), in `out` (default: beside the request, .pem). The request must ask for the first
    of them (a mix-up of requests is refused: ValueError). Returns the certificate's path."""
    _check_names(parties)
    asked = request_subject(csr)
    if asked != parties[0]:
        raise ValueError(f"{csr} asks for {asked or 'no name'!r}, not {parties[0]!r}: sign each site's own request "
                         f"for its own parties")
    ca, ca_key = _ensure_ca(ca_folder)
    out = out or os.path.splitext(csr)[0] + ".pem"
    _sign(ca, ca_key, csr, parties, days, out)
    return out


def make_certificates(folder: str, parties: Sequence[str], days: int = DAYS,
                      force: bool = False) -> Dict[str, PartyFiles]:
    """A CA in `folder` (made once, reused after) and a certificate and key per entry of `parties`
    ("role:party_id", or "A+B" for one certificate naming both). Returns party -> its files. Refuses
    (FileExistsError) to replace a party's files unless `force`; ValueError for a malformed name."""
    groups = [p.split("+") for p in parties]
    for names in groups:
        _check_names(names)
    os.makedirs(folder, exist_ok=True)
    targets = [(names, os.path.join(folder, _file_stem(names))) for names in groups]
    if not force:
        for _, stem in targets:
            if os.path.exists(stem + ".pem") or os.path.exists(stem + ".key"):
                raise FileExistsError(f"{stem}.pem exists; pass --force to issue it again")
    ca, ca_key = _ensure_ca(folder)
    out: Dict[str, PartyFiles] = {}
    with tempfile.TemporaryDirectory(prefix="fate-rdma-tls-") as tmp:
        for names, stem in targets:
            csr = os.path.join(tmp, "req.csr")
            _key_and_request(stem, names, csr)
            _sign(ca, ca_key, csr, names, days, stem + ".pem")
            for n in names:
                out[n] = PartyFiles(names, stem + ".pem", stem + ".key", ca)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("examples (no private key leaves its site):\n"
                "  at the site of guest:9999:   fate-rdma tls request ./tls --party guest:9999\n"
                "  at the federation's CA:      fate-rdma tls sign ./ca guest_9999.csr --party guest:9999\n"
                "  back at the site (with guest_9999.pem and ca.pem from the CA):\n"
                "    fate-rdma flow setup --tls --tls-cert tls/guest_9999.pem --tls-key tls/guest_9999.key "
                "--tls-ca tls/ca.pem ...\n"
                "  one operator for every site (a lab): fate-rdma tls init ./tls --parties guest:9999 host:10000\n"
                "exit codes: 0 ok, 1 openssl failed, 2 bad usage")
    sub = p.add_subparsers(dest="tls_action", metavar="ACTION", required=True)
    i = sub.add_parser("init", help="make a federation CA (once) and a certificate and key per party",
                       description=__doc__.split("\n\n")[0])
    i.add_argument("dir", help="folder for ca.pem, ca.key and PARTY.pem/PARTY.key (made if absent)")
    i.add_argument("--parties", nargs="+", required=True, metavar="ROLE:PARTY_ID",
                   help="the parties, e.g. guest:9999 host:10000; A+B = one certificate for a site running both")
    i.add_argument("--days", type=int, default=DAYS, help=f"validity of the party certificates (default {DAYS})")
    i.add_argument("--force", action="store_true", help="issue again a party whose files exist")
    r = sub.add_parser("request", help="at a site: make its key (it stays there) and a certificate request for the CA",
                       description="Make this site's private key (mode 600; it never leaves the site) and a "
                                   "certificate request to send to the federation CA's operator.")
    r.add_argument("dir", help="folder for PARTY.key and PARTY.csr (made if absent)")
    r.add_argument("--party", nargs="+", required=True, metavar="ROLE:PARTY_ID",
                   help="the party (or parties) this site runs, e.g. guest:9999")
    g = sub.add_parser("sign", help="at the federation CA: issue the certificate for a site's request",
                       description="Issue a certificate for a site's request, naming the parties given here (what "
                                   "the CA's operator vouches for); the CA is made in CA_DIR at the first use.")
    g.add_argument("ca_dir", help="the CA's folder: ca.pem and ca.key (made if absent; ca.key stays there)")
    g.add_argument("csr", help="the site's request (PARTY.csr from `fate-rdma tls request`)")
    g.add_argument("--party", nargs="+", required=True, metavar="ROLE:PARTY_ID",
                   help="the parties the certificate names; the request must ask for the first")
    g.add_argument("--days", type=int, default=DAYS, help=f"validity (default {DAYS})")
    g.add_argument("--out", default="", help="the certificate's path (default: beside the request, .pem)")


def run(args: argparse.Namespace) -> int:
    action = {"request": _run_request, "sign": _run_sign}.get(args.tls_action, _run_init)
    try:
        return action(args)
    except (ValueError, FileExistsError) as exc:
        print(f"fate-rdma tls {args.tls_action}: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"fate-rdma tls {args.tls_action}: {exc}", file=sys.stderr)
        return 1


def _run_request(args: argparse.Namespace) -> int:
    key, csr = request_certificate(os.path.abspath(args.dir), args.party)
    print(f"made this site's key {key} (mode 600: it stays here, never send it) and the request {csr}.\n"
          f"Send {os.path.basename(csr)} to the federation CA's operator, who runs\n"
          f"  fate-rdma tls sign CA_DIR {os.path.basename(csr)} --party {' '.join(args.party)}\n"
          f"and sends back {os.path.splitext(os.path.basename(csr))[0]}.pem and ca.pem; then this site's file says\n"
          f"  tls: true\n  tls_cert: {os.path.splitext(csr)[0]}.pem\n  tls_key: {key}\n  tls_ca: <where ca.pem is>")
    return 0


def _run_sign(args: argparse.Namespace) -> int:
    had_ca = os.path.exists(os.path.join(args.ca_dir, "ca.key"))
    cert = sign_request(os.path.abspath(args.ca_dir), args.csr, args.party, args.days, args.out)
    ca = os.path.join(os.path.abspath(args.ca_dir), "ca.pem")
    print(f"{'used the existing' if had_ca else 'made a'} federation CA in {os.path.abspath(args.ca_dir)} (ca.key "
          f"stays there) and issued {cert}, naming {', '.join(args.party)}, valid {args.days} days.\n"
          f"Send {cert} and {ca} back to the site (certificates are public; no key travels).")
    return 0


def _run_init(args: argparse.Namespace) -> int:
    folder = os.path.abspath(args.dir)
    had_ca = os.path.exists(os.path.join(folder, "ca.key"))
    files = make_certificates(folder, args.parties, args.days, args.force)
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
