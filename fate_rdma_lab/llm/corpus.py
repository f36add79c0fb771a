"""A small AdvertiseGen-like corpus (product attributes -> ad copy), generated from a seed, and a
word-level tokenizer built from it offline. Nothing is downloaded."""
from __future__ import annotations

import random
from typing import Dict, List, Tuple

KINDS = ["dress", "skirt", "shirt", "coat", "jacket", "sweater", "jeans", "sneakers", "bag", "scarf"]
COLORS = ["blue", "black", "white", "red", "green", "beige", "grey", "pink", "navy", "yellow"]
STYLES = ["casual", "elegant", "sporty", "vintage", "minimal", "bold", "fresh", "classic"]
MATERIALS = ["cotton", "linen", "wool", "denim", "silk", "leather", "knit", "chiffon"]
FEATURES = ["pockets", "a high waist", "a loose fit", "a slim cut", "buttons", "a hood", "pleats", "embroidery"]
OPENERS = ["Meet the", "Say hello to the", "Discover this", "Step out in this", "Treat yourself to this"]
CLOSERS = ["made for every day.", "ready for the weekend.", "that goes with everything.",
           "you will reach for again and again.", "that turns heads in the city."]

PROMPT_SEP = " => "
EOS = "<eos>"
PAD = "<pad>"
UNK = "<unk>"


def examples(n: int, seed: int = 0) -> List[Tuple[str, str]]:
    """`n` (attributes, ad copy) pairs, e.g. ("type#dress*color#blue*style#fresh*material#linen", "...")."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind, color, style = rng.choice(KINDS), rng.choice(COLORS), rng.choice(STYLES)
        material, feature = rng.choice(MATERIALS), rng.choice(FEATURES)
        attrs = f"type#{kind}*color#{color}*style#{style}*material#{material}"
        copy = (f"{rng.choice(OPENERS)} {style} {color} {kind} in soft {material} with {feature} , "
                f"a {kind} {rng.choice(CLOSERS)}")
        out.append((attrs, copy))
    return out


def vocabulary() -> Dict[str, int]:
    """Every word the generator can produce, in a fixed order (ids do not depend on the sample)."""
    words = [PAD, EOS, UNK, "=", ">", "#", "*", ",", ".", "type", "color", "style", "material"]
    for group in (KINDS, COLORS, STYLES, MATERIALS, FEATURES, OPENERS, CLOSERS):
        for phrase in group:
            for w in phrase.replace(".", " .").split():
                if w not in words:
                    words.append(w)
    for w in "in soft with a".split():
        if w not in words:
            words.append(w)
    return {w: i for i, w in enumerate(words)}


def tokenizer():
    """A transformers fast tokenizer (word level, whitespace and punctuation split), built offline."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocabulary(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


class AdDataset:
    """Causal-LM samples "attributes => copy <eos>", padded to `max_len`; loss on the copy only."""

    def __init__(self, pairs: List[Tuple[str, str]], tok, max_len: int = 64) -> None:
        import torch

        self.items = []
        for attrs, copy in pairs:
            prompt = tok(attrs + PROMPT_SEP, add_special_tokens=False)["input_ids"]
            target = tok(copy, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = (prompt + target)[:max_len]
            labels = ([-100] * len(prompt) + target)[:max_len]
            pad = max_len - len(ids)
            self.items.append({
                "input_ids": torch.tensor(ids + [tok.pad_token_id] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(labels + [-100] * pad),
            })

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def main(argv=None) -> int:
    """Write a generated corpus as AdvertiseGen-style JSON lines (for fate-flow jobs)."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--out", required=True, help="file to write (JSON lines: content, summary)")
    p.add_argument("--n", type=int, default=1000, help="examples (default 1000)")
    p.add_argument("--seed", type=int, default=1, help="seed; give each party its own (default 1)")
    a = p.parse_args(argv)
    import os

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)  # (its folder is what a job binds)
    with open(a.out, "w") as f:
        for attrs, copy in examples(a.n, a.seed):
            f.write(json.dumps({"content": attrs, "summary": copy}) + "\n")
    print(f"wrote {a.n} examples to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
