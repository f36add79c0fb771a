"""FATE 2.2's own hetero coordinated LR (fate.ml.glm CoordinatedLRModuleGuest/Host/Arbiter) as a FATE
launcher job, for tests/test_fate_lr.py: run it plain or under `fate-rdma launch`, same results either way.

    python tests/coordinated_lr_job.py --parties guest:9999 host:10000 arbiter:10000 --out lr_out
    fate-rdma launch --conf CONF tests/coordinated_lr_job.py --parties guest:9999 host:10000 arbiter:10000 --out lr_out

Tiny generated data (deterministic, nothing downloaded): the guest holds the label y and `--guest-features`
features, the host `--host-features` others, of the same `--rows` samples. The two align their rows as
FATE's toy example does (an indexer each way), then train `--epochs` epochs in mini-batches with Paillier
(the arbiter makes the keys and decrypts the gradients), exactly as the coordinated_lr component's
train() does, and the guest and host predict on the training data. Each party writes `<role>.json` under
`--out`: its model (FATE's get_model(): coefficients, intercept, optimizer state) and, for the guest, the
predictions by sample id; plus its fate-rdma counters (null when fate-rdma is off).
"""
# (no `from __future__ import annotations`: FATE's argument parser reads the dataclass types)
import json
import os
from dataclasses import dataclass, field


@dataclass
class Args:
    out: str = field(default="lr_out")
    rows: int = field(default=120)
    guest_features: int = field(default=3)
    host_features: int = field(default=4)
    epochs: int = field(default=3)
    batch_size: int = field(default=40)
    seed: int = field(default=7)
    key_length: int = field(default=1024)
    partition: int = field(default=2)


def make_data(args):
    """Both parties' columns of one data set, from one seed: y depends on guest and host features alike."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(args.seed)
    n, g, h = args.rows, args.guest_features, args.host_features
    x = rng.standard_normal((n, g + h))
    w = rng.uniform(-1.5, 1.5, g + h)
    y = (x @ w + 0.3 * rng.standard_normal(n) > 0).astype(np.int32)
    ids = [str(i) for i in range(n)]
    guest = pd.DataFrame({"sample_id": ids, "id": ids, "y": y, **{f"x{j}": x[:, j] for j in range(g)}})
    host = pd.DataFrame({"sample_id": ids, "id": ids, **{f"x{g + j}": x[:, g + j] for j in range(h)}})
    return guest, host


def plain(o):
    """JSON-safe copy of a model dict (torch tensors / numpy values as lists and numbers)."""
    if isinstance(o, dict):
        return {str(k): plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [plain(v) for v in o]
    if hasattr(o, "tolist"):
        return o.tolist()
    return o


def run(ctx):
    from fate.arch.dataframe import PandasReader
    from fate.arch.launchers.argparser import HfArgumentParser
    from fate.ml.glm import CoordinatedLRModuleArbiter, CoordinatedLRModuleGuest, CoordinatedLRModuleHost

    args = HfArgumentParser(Args).parse_args_into_dataclasses(return_remaining_strings=True)[0]
    me = ctx.local.role
    # the coordinated_lr component's parameters (fate/components/components/coordinated_lr.py), with a
    # fixed init seed so that two runs can be compared bit for bit
    optimizer = {"method": "sgd", "penalty": "l2", "alpha": 0.01, "optimizer_params": {"lr": 0.15, "weight_decay": 0}}
    lr_scheduler = {"method": "linear", "scheduler_params": {"start_factor": 1.0}}
    init_param = {"method": "random_uniform", "fit_intercept": True, "random_state": args.seed}
    ctx.cipher.set_phe(ctx.device, {"kind": "paillier", "key_length": args.key_length})
    result = {"role": me}

    if me == "arbiter":
        module = CoordinatedLRModuleArbiter(epochs=args.epochs, early_stop="diff", tol=0.0, batch_size=args.batch_size,
                                            optimizer_param=optimizer, learning_rate_param=lr_scheduler)
        module.fit(ctx.sub_ctx("train"))
    else:
        guest_pd, host_pd = make_data(args)
        label = {"label_name": "y", "label_type": "int32"} if me == "guest" else {}
        reader = PandasReader(sample_id_name="sample_id", match_id_name="id", dtype="float64",
                              partition=args.partition, **label)
        df = reader.to_frame(ctx, guest_pd if me == "guest" else host_pd)
        # align the rows (what an intersection would leave), as fate/components/components/toy_example.py does
        actx = ctx.sub_ctx("align")
        if me == "guest":
            actx.hosts.put("guest_index", df.get_indexer(target="sample_id"))
            df = df.loc(actx.hosts[0].get("host_index"), preserve_order=True)
        else:
            df = df.loc(actx.guest.get("guest_index"))
            actx.guest.put("host_index", df.get_indexer(target="sample_id"))
        assert df.shape[0] == args.rows, df.shape
        common = dict(epochs=args.epochs, batch_size=args.batch_size, optimizer_param=optimizer,
                      learning_rate_param=lr_scheduler, init_param=init_param, floating_point_precision=23)
        if me == "guest":
            module = CoordinatedLRModuleGuest(threshold=0.5, **common)
        else:
            module = CoordinatedLRModuleHost(**common)
        module.fit(ctx.sub_ctx("train"), df)
        pred = module.predict(ctx.sub_ctx("predict"), df)
        if me == "guest":
            pdf = pred.as_pd_df()
            pdf = pdf.sort_values("sample_id", key=lambda s: s.astype(int))
            result["predictions"] = {str(sid): [float(score), str(res)] for sid, score, res in
                                     zip(pdf["sample_id"], pdf["predict_score"], pdf["predict_result"])}
    result["model"] = plain(module.get_model())
    rdma = getattr(ctx.federation, "fate_rdma", None)
    result["rdma"] = dict(rdma.stats) if rdma else None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{me}.json"), "w") as f:
        json.dump(result, f, sort_keys=True)


if __name__ == "__main__":
    from fate.arch.launchers.multiprocess_launcher import launch

    launch(run, extra_args_desc=[Args])
