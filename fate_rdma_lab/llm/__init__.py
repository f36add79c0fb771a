"""FATE-LLM jobs used by the examples, the demo, the tests and `fate-rdma bench fate`: GPT-2 (built
from its config, random init) fine-tuned with FATE-LLM's FedAvg on a generated AdvertiseGen-like
corpus with an offline tokenizer. Needs the `fate` extra (torch, transformers, peft, FATE-LLM)."""
