"""GPT-2 full fine-tune, FedAvg with FATE-LLM (guest + host + arbiter) on FATE's multiprocess launcher.

Without fate-rdma (FATE's own federation):
    python examples/gpt2_full_fedavg/run.py --parties guest:9999 host:10000 arbiter:10000 --log_level WARNING
With fate-rdma (same job, one switch):
    fate-rdma launch --conf examples/gpt2_full_fedavg/fate_rdma.yaml examples/gpt2_full_fedavg/run.py \
        --parties guest:9999 host:10000 arbiter:10000 --log_level WARNING
Options (see `fate_rdma_lab/llm/gpt2_fedavg.py`): --model gpt2|tiny --rounds N --steps_per_round N --out DIR
"""
from fate_rdma_lab.llm.gpt2_fedavg import main

if __name__ == "__main__":
    main()
