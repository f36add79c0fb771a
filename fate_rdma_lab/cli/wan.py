"""`fate-rdma wan up|down|status|check`: a WAN testbed with real packets on this machine (root).

Two or three sites (network namespaces PREFIX-a, -b, -c at 198.18.1.2, .2.2, .3.2) behind a router
namespace PREFIX-r. Each site's access link is shaped: rate (tbf, both directions), one-way delay and
reordering (a C helper on a TUN in the router: netem is not in this kernel), random loss (nftables).
A path A->B runs at min(rate_a, rate_b) with delay_a one way, so RTT(A,B) = delay_a + delay_b;
--rtt-ms R gives every link delay R/2. `up` measures RTT and a TCP stream a -> b and prints them.

  fate-rdma wan up --rate-mbit 100 --rtt-ms 20 --loss-pct 0.1
  fate-rdma wan up --sites 3 --link c:rate_mbit=20,delay_ms=40      # one slower, farther site
  ip netns exec frwan-a CMD                                         # run anything in site a
  fate-rdma wan check --bytes 8388608        # fate-rdma channel and TCP a -> b, crc32c verified
  fate-rdma wan status [--measure]
  fate-rdma wan down

`up` on an existing testbed reshapes it in place (processes in the sites keep running); a failed
`up` removes everything it made. `down` stops the helper and the processes inside the namespaces,
then deletes them (veths, qdiscs, nft table and routes go with them) and checks nothing is left.
Results are real packets at a scaled rate: 10 Gbit/s x 20 ms cannot be carried by 2 cores.
Exit codes: 0 ok; 1 failed (or, for status, no testbed); 2 bad usage; 3 this host cannot build one.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List

HELP = 'a WAN testbed with real packets: sites as namespaces, shaped links (up/down/status/check)'
#: starts process groups of its own: SIGTERM stops them as Ctrl-C does
STOPS_ITS_CHILDREN = True

EXIT_UNAVAILABLE = 3
LINK_KEYS = {"rate_mbit", "delay_ms", "loss_pct", "reorder_pct", "gap_ms"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    sub = p.add_subparsers(dest="wan_action", metavar="ACTION", required=True)
    u = sub.add_parser("up", help="build (or reshape) the testbed and measure it",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    u.add_argument("--sites", type=int, choices=[2, 3], default=2, help="number of sites")
    u.add_argument("--rate-mbit", type=float, default=100.0,
                   help="every link's rate in Mbit/s, both directions (0: unshaped)")
    u.add_argument("--rtt-ms", type=float, default=10.0, help="round trip between any two sites (delay RTT/2 per link)")
    u.add_argument("--loss-pct", type=float, default=0.0, help="random loss of packets leaving each site, percent")
    u.add_argument("--reorder-pct", type=float, default=0.0,
                   help="percent of packets held --reorder-gap-ms longer, so later ones overtake them")
    u.add_argument("--reorder-gap-ms", type=float, default=2.0, help="extra hold of a reordered packet")
    u.add_argument("--link", action="append", default=[], metavar="SITE:KEY=V,...",
                   help=f"override one site's link; keys {', '.join(sorted(LINK_KEYS))} (repeatable)")
    u.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue length as time at the link's rate")
    u.add_argument("--tcp-cc", default=None, metavar="NAME",
                   help="TCP congestion control in every site (e.g. cubic, bbr; default: the host's)")
    u.add_argument("--measure-seconds", type=float, default=2.0, help="TCP stream length of the measurement (0: RTT only)")
    u.add_argument("--no-measure", action="store_true", help="skip the measurement")
    _common(u)
    d = sub.add_parser("down", help="remove the testbed: namespaces, veths, qdiscs, nft table, helper, processes")
    _common(d)
    s = sub.add_parser("status", help="show what exists of the testbed (and --measure it again)")
    s.add_argument("--measure", action="store_true", help="measure RTT and a TCP stream a -> b now")
    _common(s)
    c = sub.add_parser("check", help="send bytes a -> b through fate-rdma and plain TCP; verify crc32c",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c.add_argument("--bytes", type=int, default=8 << 20, help="payload size in bytes (default 8 MiB)")
    c.add_argument("--src", default="a", choices=list("abc"), help="sending site (default a)")
    c.add_argument("--dst", default="b", choices=list("abc"), help="receiving site (default b)")
    c.add_argument("--mode", default="fedrdma-e", choices=["fedrdma", "fedrdma-e"], help="channel mode (default fedrdma-e)")
    c.add_argument("--chunk-bytes", type=int, default=1 << 20,
                   help="chunk size of the check's transfers (default 1 MiB, smaller than the channel's 4 MiB "
                        "default: more chunks on a slow testbed link)")
    c.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each transfer")
    _common(c)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default="frwan", help="namespace name prefix (several testbeds can coexist)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _links(args: argparse.Namespace) -> List[Any]:
    from fate_rdma_lab.testbed.bed import SITE_NAMES, LinkSpec

    def spec(rate_mbit: float, delay_ms: float, loss_pct: float, reorder_pct: float, gap_ms: float) -> LinkSpec:
        return LinkSpec(rate_bps=int(rate_mbit * 1e6) if rate_mbit > 0 else None, delay_ms=delay_ms,
                        loss_pct=loss_pct, reorder_pct=reorder_pct, reorder_gap_ms=gap_ms)

    base = dict(rate_mbit=args.rate_mbit, delay_ms=args.rtt_ms / 2, loss_pct=args.loss_pct,
                reorder_pct=args.reorder_pct, gap_ms=args.reorder_gap_ms)
    per = [dict(base) for _ in range(args.sites)]
    for item in args.link:
        site, sep, kvs = item.partition(":")
        if not sep or site not in SITE_NAMES[:args.sites]:
            raise ValueError(f"--link {item!r}: want SITE:KEY=V,... with SITE one of {SITE_NAMES[:args.sites]}")
        for kv in kvs.split(","):
            k, eq, v = kv.partition("=")
            if not eq or k not in LINK_KEYS:
                raise ValueError(f"--link {item!r}: unknown key {k!r} (keys: {', '.join(sorted(LINK_KEYS))})")
            try:
                per[SITE_NAMES.index(site)][k] = float(v)
            except ValueError:
                raise ValueError(f"--link {item!r}: {k} wants a number, got {v!r}") from None
    return [spec(**d) for d in per]


def _print_status(st: Dict[str, Any]) -> None:
    from fate_rdma_lab.testbed.bed import Testbed, testbed_note
    from fate_rdma_lab.testbed.run import format_measurement

    state = st.get("state") or {}
    tb = Testbed.from_dict(state["spec"]) if state.get("spec") else None
    if not st["namespaces"]:
        print(f"no testbed with prefix {st['prefix']!r}")
        return
    print(f"testbed {st['prefix']}: namespaces {', '.join(st['namespaces'])}")
    if tb is not None:
        for i, link in enumerate(tb.links):
            print(f"  site {'abc'[i]} ({tb.site_ns(i)}, {tb.site_addr(i)}): {link.describe()}")
    for ns, info in st["namespaces"].items():
        print(f"  {ns}: {'; '.join(info['addresses']) or 'no addresses'}")
        for q in info["qdiscs"]:
            print(f"    {q}")
        if info.get("nft"):
            for line in info["nft"].splitlines():
                if "drop" in line:
                    print(f"    nft: {line.strip()}")
        if info["pids"]:
            print(f"    processes inside: {' '.join(info['pids'])}")
    h = st.get("helper")
    if h:
        stats = h.get("stats", {})
        print(f"  delay helper pid {h['pid']} {'alive' if h['alive'] else 'NOT RUNNING'}: "
              + ", ".join(f"{k} {v}" for k, v in stats.items()))
    if state.get("measured"):
        print("  " + format_measurement(state["measured"]).replace("\n", "\n  "))
    else:
        print(f"  {testbed_note(tb)}")


def run(args: argparse.Namespace) -> int:
    """(SIGTERM arrives as Ctrl-C, fate_rdma.cli.main: `up` removes what it made, `check` stops its processes.)"""
    from fate_rdma_lab.testbed import bed as wan

    prefix = args.prefix
    try:
        if args.wan_action == "up":
            try:
                tb = wan.Testbed(links=tuple(_links(args)), prefix=prefix, queue_ms=args.queue_ms,
                                 tcp_cc=args.tcp_cc)
            except (ValueError, wan.WanError) as exc:
                print(f"fate-rdma wan up: {exc}", file=sys.stderr)
                return 2
        try:
            wan.check_prefix(prefix)
        except wan.WanError as exc:
            print(f"fate-rdma wan {args.wan_action}: {exc}", file=sys.stderr)
            return 2
        problem = wan.host_problem()
        if problem:
            raise wan.WanUnavailable(problem)
        if args.wan_action == "up":
            log = (lambda s: None) if args.json else (lambda s: print(s, flush=True))
            from fate_rdma_lab.testbed.run import measure

            state = wan.up(tb, measure_seconds=-1 if args.no_measure else args.measure_seconds, log=log, measure=measure)
            if args.json:
                print(json.dumps(state))
            else:
                _print_status(wan.status(prefix))
            return 0
        if args.wan_action == "down":
            done = wan.down(prefix)
            left = wan.leftovers(prefix)
            if args.json:
                print(json.dumps({"removed": done, "left": left}))
            else:
                print("\n".join(done) if done else f"nothing of testbed {prefix!r} to remove")
                if left:
                    print(f"STILL PRESENT: {', '.join(left)}", file=sys.stderr)
            return 1 if left else 0
        if args.wan_action == "status":
            st = wan.status(prefix)
            if args.measure and st["namespaces"] and (st.get("state") or {}).get("spec"):
                from fate_rdma_lab.testbed.run import measure

                st["state"]["measured"] = measure(wan.Testbed.from_dict(st["state"]["spec"]))
            print(json.dumps(st)) if args.json else _print_status(st)
            return 0 if st["namespaces"] else 1
        # check
        from fate_rdma_lab.testbed.run import check_transfer, format_check

        saved = wan.load_state(prefix)
        if not saved or not wan.existing_namespaces(prefix):
            print(f"fate-rdma wan check: no testbed {prefix!r}; run `fate-rdma wan up` first", file=sys.stderr)
            return 1
        tb = wan.Testbed.from_dict(saved["spec"])
        src, dst = "abc".index(args.src), "abc".index(args.dst)
        if src == dst or max(src, dst) >= len(tb.links):
            print(f"fate-rdma wan check: --src/--dst must be two different sites of {'abc'[:len(tb.links)]}",
                  file=sys.stderr)
            return 2
        res = check_transfer(tb, args.bytes, src, dst, mode=args.mode, chunk_bytes=args.chunk_bytes,
                             timeout_s=args.timeout_s)
        print(json.dumps(res)) if args.json else print(format_check(res))
        return 0
    except KeyboardInterrupt:
        # `up` has already removed what it made (its cleanup runs on any exception)
        print(f"fate-rdma wan {args.wan_action}: interrupted", file=sys.stderr)
        return 1
    except wan.WanUnavailable as exc:
        print(f"fate-rdma wan {args.wan_action}: this host cannot build the testbed: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except wan.WanError as exc:
        print(f"fate-rdma wan {args.wan_action}: {exc}", file=sys.stderr)
        return 1
