"""LoRA rank sweep (the FedRDMA paper's Table 3, with our own figures): for GPT-2 LoRA on c_attn at
ranks 4 ... 1024, the FedAvg payload (FATE's secure aggregation: float64, mixed, up; the average down),
the chunks it takes, and the communication time per round over FATE's own federation and over
fate-rdma, guest + host + arbiter on this machine. A table and JSON lines; about 10 minutes.

    python examples/lora_rank_sweep/run.py                 # ranks 4,8,...,1024, 3 rounds each
    python examples/lora_rank_sweep/run.py --ranks 8,64 --rounds 2

It runs `fate-rdma bench fate --lora-ranks ...`; see `fate-rdma bench fate --help` for the options.
"""
import argparse
import sys

from fate_rdma.cli import main

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--rounds", type=int, default=3)
    a, rest = ap.parse_known_args()
    sys.exit(main(["bench", "fate", "--lora-ranks", a.ranks, "--rounds", str(a.rounds)] + rest))
