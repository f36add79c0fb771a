"""LoRA rank sweep, GPT-2 LoRA on c_attn at ranks 4 ... 1024, guest + host + arbiter on this machine.

By default, the sweep as its users run it (`fate-rdma sweep lora`): real GPT-2 LoRA FedAvg training
through FATE-LLM at each rank for a few rounds over fate-rdma, recording per round the loss reached,
computation and communication seconds, payload per client and peak RSS; results.jsonl, table.md and
lora_sweep.png in results/sweep/<UTC time>/, resumable with --resume DIR. About 12 minutes on 2 CPU
cores with the defaults; `--device cuda` runs the same on a CUDA machine.

    python examples/lora_rank_sweep/run.py                          # ranks 4,8,...,1024, 3 rounds each
    python examples/lora_rank_sweep/run.py --ranks 4,64,1024 --rounds 2 --also-fate
    python examples/lora_rank_sweep/run.py --resume results/sweep/20250101T120000Z

With --payload-only, the payloads alone (the FedRDMA paper's Table 3, no training): the FedAvg
payload of each rank through FATE's own federation and through fate-rdma, 3 rounds, a table and JSON
lines, about 10 minutes (`fate-rdma bench fate --lora-ranks ...`):

    python examples/lora_rank_sweep/run.py --payload-only --ranks 8,64 --rounds 2

See `fate-rdma sweep lora --help` and `fate-rdma bench fate --help` for every option. The soft
provider (verbs emulated over TCP) is an emulation, not RDMA; its figures say so.
"""
import argparse
import sys

from fate_rdma.cli import main

DEFAULT_RANKS = "4,8,16,32,64,128,256,512,1024"

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payload-only", action="store_true",
                    help="sweep the FedAvg payloads without training (fate-rdma bench fate --lora-ranks)")
    ap.add_argument("--ranks", default=None, help=f"comma list of LoRA ranks (default {DEFAULT_RANKS})")
    ap.add_argument("--rounds", type=int, default=None, help="FedAvg rounds per rank (default 3)")
    a, rest = ap.parse_known_args()
    if a.payload_only:
        argv = ["bench", "fate", "--lora-ranks", a.ranks or DEFAULT_RANKS, "--rounds", str(a.rounds or 3)]
    else:  # the sweep's own defaults (and, on --resume, the resumed folder's settings) apply when not given
        argv = ["sweep", "lora"] + (["--ranks", a.ranks] if a.ranks else []) + \
               (["--rounds", str(a.rounds)] if a.rounds else [])
    sys.exit(main(argv + rest))
