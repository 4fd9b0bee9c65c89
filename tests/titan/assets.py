"""Test assets made at test time: a tiny BPE tokenizer and a small local text data set.

The torchtitan wheel ships neither (its configs point at ``./tests/assets`` of the source tree) and CI
reaches only package registries, so both are generated here, deterministically, with the
``tokenizers`` package torchtitan already depends on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["make_assets"]

_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "her", "an", "which", "this", "be", "are", "were", "had", "it", "not", "or",
    "have", "but", "one", "all", "they", "she", "he", "their", "there", "been", "has", "when",
    "who", "more", "would", "about", "process", "group", "mesh", "rank", "world", "shard",
    "context", "tensor", "pipeline", "expert", "replicate", "gradient", "loss", "model", "layer",
    "token", "batch", "step", "checkpoint", "save", "load", "train", "stream", "collective",
    "gather", "reduce", "scatter", "broadcast", "barrier", "timeout", "device", "host", "memory",
    "kernel", "attention", "sequence", "window",
)


def _text(seed: int, documents: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(documents):
        sentences = []
        for _ in range(rng.randint(4, 12)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def make_assets(root: Path, *, vocab_size: int = 512, documents: int = 400) -> tuple[Path, Path]:
    """Write ``root/tokenizer`` (tokenizer.json + tokenizer_config.json) and ``root/c4_test``.

    Returns ``(tokenizer_dir, dataset_dir)``. The data set is JSON lines with a ``text`` field, the
    shape of torchtitan's ``c4_test``; ``vocab_size`` must stay below the model's (2048 for the
    debug models). Idempotent: existing files are kept.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer_dir, dataset_dir = root / "tokenizer", root / "c4_test"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    dataset_dir.mkdir(parents=True, exist_ok=True)
    docs = _text(seed=0, documents=documents)
    # "train" in the file name: the datasets library infers the split from it.
    data_file = dataset_dir / "train.jsonl"
    if not data_file.exists():
        tmp = data_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        tmp.replace(data_file)
    tokenizer_file = tokenizer_dir / "tokenizer.json"
    if not tokenizer_file.exists():
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(docs, trainer=trainer)
        tmp = tokenizer_file.with_suffix(".tmp")
        tokenizer.save(str(tmp))
        tmp.replace(tokenizer_file)
        (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "add_bos_token": True,
            "add_eos_token": True,
        }))
    # Build the datasets cache once here, so ranks loading at once do not race to write it.
    from datasets import load_dataset

    load_dataset(str(dataset_dir), split="train")
    return tokenizer_dir, dataset_dir
