"""`fate-rdma launch --conf FILE SCRIPT [ARGS...]`: run a FATE launcher script (e.g. one using
fate.arch.launchers.multiprocess_launcher) with fate-rdma switched on for every party process.

When every party runs on this machine and the section names no secret_file, the launcher makes a
fresh secret for the job (in a private temporary folder, removed afterwards), so the parties
authenticate each other; parties on other hosts need the site's secret_file."""
from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import shutil
import sys
import tempfile
from typing import Any, Dict, Tuple


EPILOG = """\
example:
  fate-rdma launch --conf conf/fate_rdma_launcher.yaml my_job.py \\
      --parties guest:9999 host:10000 arbiter:10000 --log_level WARNING

The script runs as with `python SCRIPT`, with FATE_RDMA_CONF set for every party process it starts (the
start-up hook must be installed: `fate-rdma hook install`, which make does), and, unless --huge-pages off,
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 where the kernel (transparent huge pages: madvise or always) and
glibc (2.35+) allow it: the arrays FATE's secure aggregation allocates with malloc then sit in huge pages,
which the channel reads faster (another process read them at 13.7 against 5.4 GB/s a thread
here; FATE's own rounds were 1.1-1.7 x faster with them too; a same-host round's gain did not hold up).
When every endpoint is on this machine and the section names no secret_file (and tls is off), the job
gets a fresh secret, so the parties authenticate each other; parties on other hosts need the site's
secret_file.

A party process that ends without reporting to FATE's launcher (its federation failed to start, e.g. a
port already taken, or it was killed) fails the job about 2.5 s later, naming the party and its exit
status; FATE's launcher then stops the other parties (it waits 10 s first), instead of every process
waiting for the one that is gone.

exit status: the script's (a FATE launcher job: 0 when every party finished, 1 when one failed); 2 for
a missing or invalid --conf, a missing script or a missing hook."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--conf", required=True,
                   help="YAML/JSON file with a fate_rdma section (see conf/fate_rdma_launcher.yaml)")
    p.add_argument("--huge-pages", choices=["auto", "off"], default="auto",
                   help="auto (default): start the party processes with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 where "
                        "the kernel and glibc allow it, so the arrays FATE allocates with malloc sit in huge pages, "
                        "which the channel reads faster (fate_rdma/hugepages.py); off: leave the "
                        "environment as it is")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..federation.flow import apply_site_policy
    from ..federation.config import RdmaFederationConfig, load_section

    if not os.path.isfile(args.conf):
        print(f"fate-rdma launch: --conf {args.conf!r} is not a file", file=sys.stderr)
        return 2
    if not os.path.exists(args.script):  # (a folder or zip with __main__.py runs too)
        print(f"fate-rdma launch: the script {args.script!r} does not exist", file=sys.stderr)
        return 2
    try:
        section = load_section(os.path.abspath(args.conf))
        if section is None:
            print(f"fate-rdma launch: {args.conf} has no fate_rdma section", file=sys.stderr)
            return 2
        # fail early on a bad configuration, or one the site's policy refuses (the parties apply it again)
        cfg = RdmaFederationConfig.from_section(apply_site_policy(section, f"{args.conf} (fate_rdma)"))
    except ConfigError as exc:
        print(f"fate-rdma launch: {args.conf}: {exc}", file=sys.stderr)
        return 2
    from ..federation.hook import pth_path

    if not os.path.exists(pth_path()):
        print("fate-rdma launch: the start-up hook is not installed in this environment, so FATE's party "
              "processes would not see fate-rdma; run `fate-rdma hook install` first", file=sys.stderr)
        return 2
    conf, secret_dir = os.path.abspath(args.conf), None
    if cfg.channel.secret_file is None and cfg.channel.auth != "none" and not cfg.channel.tls:
        # (parties on other hosts; a listen_host off loopback is fine: the job's own secret below covers it)
        if cfg.hosts_off_loopback(listen=False):
            print("fate-rdma launch: parties on other hosts need the federation's shared secret: set secret_file "
                  "in the fate_rdma section (the same secret at every site; `fate-rdma secret FILE` makes one)",
                  file=sys.stderr)
            return 2
        conf, secret_dir = _with_job_secret(section)  # every party of this job on this machine: a fresh secret
    os.environ["FATE_RDMA_CONF"] = conf  # reaches the spawned party processes
    if args.huge_pages == "auto":  # (read by glibc when a process starts: FATE's launcher spawns fresh ones)
        from ..hugepages import with_huge_pages

        env, done = with_huge_pages(os.environ)
        os.environ.update(env)
        logging.getLogger("fate_rdma.launch").info("fate-rdma launch: malloc huge pages for the parties: %s", done)
    from ..federation.hook import install_import_hook

    install_import_hook()
    sys.argv = [args.script] + list(args.script_args)
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)
    return 0


def _with_job_secret(section: Dict[str, Any]) -> Tuple[str, str]:
    """A private folder with a fresh per-job secret and the section pointing at it: (conf path, folder)."""
    from ..channel.auth import write_secret

    folder = tempfile.mkdtemp(prefix="fate-rdma-job-")  # mode 700
    secret = os.path.join(folder, "secret")
    write_secret(secret)
    conf = os.path.join(folder, "fate_rdma.json")
    with open(conf, "w") as f:
        # (every party of the job on this machine, the secret its own: shared_secret_only covers a listen_host
        # off loopback, whose members are this job's parties only)
        json.dump({"fate_rdma": dict(section, secret_file=secret, auth="hmac", shared_secret_only=True)}, f)
    return conf, folder
