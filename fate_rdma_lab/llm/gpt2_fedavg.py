"""GPT-2 FedAvg with FATE-LLM (`Seq2SeqFedAVGClient` / `Seq2SeqFedAVGServer`, FATE's default secure
aggregation): guest + host train, the arbiter aggregates once per epoch (= one round). Full fine-tune
with `--lora_rank 0`, peft LoRA on `c_attn` otherwise. GPT-2 is built from `GPT2Config()` (124M
parameters, random init) or, with `--model tiny`, a two-layer GPT-2 for tests. Nothing is downloaded.

The job code knows nothing of fate-rdma: started with `fate-rdma launch --conf FILE` (or with
FATE_RDMA_CONF set, or a task conf holding a `fate_rdma` section) its weights cross over the channel,
otherwise over FATE's own federation. Each party writes `<out>/<role>.json`: the sha256 of the final
trainable weights (clients), communication seconds per round (time spent in FedAvg's aggregation
call: push, the other parties, the arbiter's sum, the pull), and at the clients per round the
computation seconds (from the round's start to its aggregation call: the local optimizer steps), the
round's wall seconds and the training loss (transformers' Trainer log with logging_strategy "epoch":
the mean loss over the round's local steps, before the average is applied); payload sizes, peak RSS
and fate-rdma counters. `fate-rdma sweep lora` runs this job once per LoRA rank.
"""
# (no `from __future__ import annotations`: FATE's argument parser reads the dataclass field types)
import hashlib
import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field

log = logging.getLogger("fate_rdma_lab.llm")


@dataclass
class JobArgs:
    model: str = field(default="gpt2", metadata={"help": "gpt2 (124M, GPT2Config()) or tiny (2 layers, for tests)"})
    lora_rank: int = field(default=0, metadata={"help": "0: full fine-tune; r > 0: peft LoRA of rank r on c_attn"})
    rounds: int = field(default=1, metadata={"help": "FedAvg rounds (one local epoch each)"})
    steps_per_round: int = field(default=2, metadata={"help": "local optimizer steps per round"})
    batch_size: int = field(default=2)
    seq_len: int = field(default=48)
    lr: float = field(default=5e-4)
    seed: int = field(default=0)
    threads: int = field(default=1, metadata={"help": "torch CPU threads per party"})
    device: str = field(default="cpu", metadata={"help": "cpu, or cuda: transformers' Trainer (under FATE-LLM's "
                                                          "Seq2SeqTrainingArguments) then trains on cuda:0"})
    out: str = field(default="gpt2_fedavg_out", metadata={"help": "folder for <role>.json results"})


def build_model(args: JobArgs, vocab_size: int):
    """GPT-2 (real size or tiny), same random init on every client (seeded), LoRA-wrapped if asked."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.model == "gpt2":
        config = GPT2Config()  # 124,439,808 parameters; vocab 50257 covers the corpus' ids
    elif args.model == "tiny":
        config = GPT2Config(vocab_size=vocab_size, n_positions=max(64, args.seq_len), n_embd=128, n_layer=2, n_head=2)
    else:
        raise ValueError(f"--model must be gpt2 or tiny, not {args.model!r}")
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    if args.lora_rank > 0:
        from peft import LoraConfig, TaskType, get_peft_model

        lora = LoraConfig(task_type=TaskType.CAUSAL_LM, r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                          lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True)
        torch.manual_seed(args.seed + 1)
        model = get_peft_model(model, lora)
    return model


def trainable_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        if p.requires_grad:
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write(args: JobArgs, role: str, record: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{role}.json"), "w") as f:
        json.dump(record, f, indent=1)


#: what FATE's secure aggregation moves per trainable parameter and round, per client: the mixed
#: float64 weights up (2 x 8 bytes a parameter; the channel's byte counts agree), the float64 average down
SECAGG_UP_BYTES_PER_PARAM = 16
SECAGG_DOWN_BYTES_PER_PARAM = 8


def _rdma_record(ctx) -> dict:
    rdma = getattr(ctx.federation, "fate_rdma", None)
    if rdma is None:
        return {"transport": "fate", "label": "FATE federation", "rdma": None}
    ep = rdma.endpoint
    # holds: stretches in which this process ran no Python (FATE code keeping the GIL), its channel stood still
    return {"transport": "fate-rdma", "label": ep.label, "rdma": dict(rdma.stats), "authenticated": ep.secret is not None,
            "holds": {"count": ep.holds, "seconds": round(ep.held_s, 3), "longest_s": round(ep.longest_hold_s, 3)}}


def run(ctx) -> None:
    """The launcher's entry point: one party of the job."""
    import torch
    from fate.arch.launchers.argparser import HfArgumentParser

    args = HfArgumentParser(JobArgs).parse_args_into_dataclasses(return_remaining_strings=True)[0]
    torch.set_num_threads(max(1, args.threads))
    role = ctx.local.role
    if role == "arbiter":
        return _run_server(ctx, args)
    return _run_client(ctx, args, role)


def _run_server(ctx, args: JobArgs) -> None:
    from fate_llm.algo.fedavg.fedavg import Seq2SeqFedAVGServer

    comm = []

    class TimedServer(Seq2SeqFedAVGServer):
        def on_federation(self, ctx, aggregator, agg_iter_idx):
            t0 = time.perf_counter()
            super().on_federation(ctx, aggregator, agg_iter_idx)
            comm.append(time.perf_counter() - t0)

    TimedServer(ctx, local_mode=False).train()
    _write(args, "arbiter", {"role": "arbiter", "comm_seconds": comm, "peak_rss_bytes": _peak_rss(), **_rdma_record(ctx)})


def _check_device(device: str) -> None:
    import torch

    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")


def _round_clock():
    """A Trainer callback that notes when each round (= epoch: aggregate_strategy "epoch") begins and when
    training ends; it only reads the clock."""
    from transformers import TrainerCallback

    class RoundClock(TrainerCallback):
        def __init__(self):
            self.begins, self.end = [], None

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.begins.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            self.end = time.perf_counter()

        def round_seconds(self):
            ends = self.begins[1:] + ([self.end] if self.end is not None else [])
            return [b - a for a, b in zip(self.begins, ends)]

    return RoundClock()


def _run_client(ctx, args: JobArgs, role: str) -> None:
    import torch
    from fate.ml.nn.homo.fedavg import FedAVGArguments
    from fate_llm.algo.fedavg.fedavg import Seq2SeqFedAVGClient
    from fate_llm.trainer.seq2seq_trainer import Seq2SeqTrainingArguments

    from fate_rdma_lab.llm import corpus

    _check_device(args.device)
    tok = corpus.tokenizer()
    n = args.steps_per_round * args.batch_size
    pairs = corpus.examples(n, seed=args.seed * 1000 + (1 if role == "guest" else 2))
    train = corpus.AdDataset(pairs, tok, max_len=args.seq_len)
    model = build_model(args, len(tok))
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in trainable)
    comm, compute = [], []
    clock = _round_clock()
    on_cuda = args.device == "cuda"

    class TimedClient(Seq2SeqFedAVGClient):
        def on_federation(self, ctx, aggregator, fed_args, args, model=None, **kw):
            if on_cuda:
                torch.cuda.synchronize()  # the round's kernels count as computation, not as the upload
            t0 = time.perf_counter()
            compute.append(t0 - clock.begins[-1] if clock.begins else float("nan"))
            super().on_federation(ctx, aggregator, fed_args, args, model=model, **kw)
            comm.append(time.perf_counter() - t0)

    targs = Seq2SeqTrainingArguments(
        output_dir=os.path.join(args.out, f"{role}_trainer"), per_device_train_batch_size=args.batch_size,
        num_train_epochs=args.rounds, learning_rate=args.lr, seed=args.seed, data_seed=args.seed,
        use_cpu=args.device == "cpu", log_level="error", logging_strategy="epoch", report_to=[],
        dataloader_num_workers=0)
    fed_args = FedAVGArguments(aggregate_strategy="epoch", aggregate_freq=1)
    t0 = time.perf_counter()
    trainer = TimedClient(ctx=ctx, model=model, training_args=targs, fed_args=fed_args, train_set=train,
                          tokenizer=tok, data_collator=None)
    trainer.add_callback(clock)  # FATE-LLM's client drops a `callbacks=` argument
    trainer.train()
    record = {
        "role": role, "model": args.model, "lora_rank": args.lora_rank, "rounds": args.rounds,
        "steps_per_round": args.steps_per_round, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "device": str(targs.device), "device_name": torch.cuda.get_device_name(0) if on_cuda else "cpu",
        "trainable_params": n_params, "tensors": len(trainable),
        # what FedAvg's secure aggregation puts per round: float64 arrays, mixed (see DESIGN.md)
        "float64_bytes": n_params * 8, "up_bytes": n_params * SECAGG_UP_BYTES_PER_PARAM,
        "down_bytes": n_params * SECAGG_DOWN_BYTES_PER_PARAM, "sha256": trainable_digest(model),
        "comm_seconds": comm, "compute_seconds": compute, "round_seconds": clock.round_seconds(),
        # the Trainer's per-epoch log: mean training loss over the round's local steps
        "train_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "job_seconds": time.perf_counter() - t0, "peak_rss_bytes": _peak_rss(), **_rdma_record(ctx),
    }
    _write(args, role, record)


def main() -> None:
    """`python -m fate_rdma_lab.llm.gpt2_fedavg --parties guest:9999 host:10000 arbiter:10000 ...`"""
    from fate.arch.launchers.multiprocess_launcher import launch

    launch(run, extra_args_desc=[JobArgs])


if __name__ == "__main__":
    main()
