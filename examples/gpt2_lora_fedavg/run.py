"""GPT-2 + peft LoRA (rank --lora_rank, default 8, on c_attn), FedAvg with FATE-LLM (guest + host +
arbiter) on FATE's multiprocess launcher.

    fate-rdma launch --conf examples/gpt2_lora_fedavg/fate_rdma.yaml examples/gpt2_lora_fedavg/run.py \
        --parties guest:9999 host:10000 arbiter:10000 --log_level WARNING --lora_rank 8
Drop `fate-rdma launch --conf ...` to run the same job over FATE's own federation.
"""
import sys

from fate_rdma_lab.llm.gpt2_fedavg import main

if __name__ == "__main__":
    if not any(a.startswith("--lora_rank") for a in sys.argv[1:]):
        sys.argv += ["--lora_rank", "8"]
    main()
