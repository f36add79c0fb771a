"""Entry points for FATE-LLM's runner (`Seq2SeqRunner` in a fate-flow job): each is what a
`{module_name, item_name, kwargs}` block of the job conf names. See examples/*/fate_flow_job.yaml."""
from __future__ import annotations

import json
import os
from typing import Any, List, Tuple

from fate_rdma_lab.llm import corpus


def gpt2_model(model: str = "gpt2", lora_rank: int = 0, seed: int = 0, seq_len: int = 64) -> Any:
    """GPT-2 built from its config (random init; 124M for "gpt2"), LoRA-wrapped when lora_rank > 0."""
    from fate_rdma_lab.llm.gpt2_fedavg import JobArgs, build_model

    return build_model(JobArgs(model=model, lora_rank=lora_rank, seed=seed, seq_len=seq_len),
                       len(corpus.vocabulary()))


def tokenizer() -> Any:
    return corpus.tokenizer()


class AdvertiseGenDataset(corpus.AdDataset):
    """AdvertiseGen-style JSON lines ({"content": attributes, "summary": ad copy}); `load(path)` takes a
    file or a folder holding train.json. Write a generated one with
    `python -m fate_rdma_lab.llm.corpus --out train.json --n 1000 --seed 1`."""

    def __init__(self, seq_len: int = 64) -> None:
        self.seq_len = seq_len
        self.items = []

    def load(self, path: str) -> "AdvertiseGenDataset":
        if os.path.isdir(path):
            path = os.path.join(path, "train.json")
        pairs: List[Tuple[str, str]] = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    pairs.append((row["content"], row["summary"]))
                except (ValueError, KeyError) as exc:
                    raise ValueError(f"{path}:{n}: want JSON with 'content' and 'summary': {exc}") from exc
        corpus.AdDataset.__init__(self, pairs, corpus.tokenizer(), max_len=self.seq_len)
        return self
