"""The trainer's data: one global batch of `batch_size` rows per step, split over the replicas.

Row `i` of the whole stream is a pure function of (seed, i), so the data position is just the
step: step `s` holds rows `[s * batch_size, (s + 1) * batch_size)`, and data-parallel replica `r`
of `dp` reads the `r`-th equal part of them. Every CP rank of a replica reads the same rows (the
batch contract of `shard_batch`, which then cuts this rank's slice). A run resumed at step `s`,
with any number of replicas, reads what the uninterrupted run would have read.

Sources: `synthetic` (random token ids), or a local `text` / `jsonl` file of documents, tokenized
by `ByteTokenizer` (UTF-8 bytes; one more id ends a document). Without packing, a row holds one
document (cycled in file order), cut to `seq_len` tokens or right-padded (attention mask 0,
label -100).
"""
from __future__ import annotations

import json

import torch

from ..batch import IGNORE_INDEX
from ..errors import PlanError
from .config import DataSettings, TrainSettings


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; `eos_id` = 256 ends a document (and pads)."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) + [self.eos_id]


def read_documents(data: DataSettings) -> list[str]:
    """The documents of a local file: blank-line separated (text), or one JSON object a line (jsonl)."""
    with open(data.path, encoding="utf-8") as handle:
        content = handle.read()
    if data.source == "text":
        documents = [doc.strip() for doc in content.split("\n\n")]
    else:
        documents = []
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                documents.append(record[data.text_field])
            except (ValueError, KeyError, TypeError) as exc:
                raise PlanError("data.path", f"line {number} is not a JSON object with a string "
                                             f"{data.text_field!r} ({exc!r})") from exc
    documents = [doc for doc in documents if isinstance(doc, str) and doc]
    if not documents:
        raise PlanError("data.path", f"{data.path} holds no document")
    return documents


class TokenStream:
    """Rows of the global data stream, by index; `batch(step, replica, replicas)` is what one
    data-parallel replica trains on at one step."""

    def __init__(self, data: DataSettings, settings: TrainSettings, vocab_size: int):
        self.settings = settings
        self.vocab_size = vocab_size
        self.documents = None
        if data.source != "synthetic":
            tokenizer = ByteTokenizer()
            if vocab_size < tokenizer.vocab_size:
                raise PlanError("model.vocab_size", f"the byte tokenizer needs {tokenizer.vocab_size} token ids, the "
                                                    f"model has {vocab_size}")
            self.documents = [tokenizer.encode(doc) for doc in read_documents(data)]
            self.pad_id = tokenizer.eos_id

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, attention mask) of global row `index`, each [seq_len]."""
        seq_len = self.settings.seq_len
        if self.documents is None:
            gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + index)
            ids = torch.randint(0, self.vocab_size, (seq_len,), generator=gen)
            return ids, torch.ones_like(ids)
        tokens = self.documents[index % len(self.documents)][:seq_len]
        ids = torch.full((seq_len,), self.pad_id, dtype=torch.long)
        ids[: len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[: len(tokens)] = 1
        return ids, mask

    def batch(self, step: int, replica: int = 0, replicas: int = 1) -> dict[str, torch.Tensor]:
        """The global batch of one replica at `step` (0-based): input_ids, attention_mask, labels."""
        rows_per_replica = self.settings.batch_size // replicas
        first = step * self.settings.batch_size + replica * rows_per_replica
        ids, mask = (torch.stack(t) for t in zip(*(self.row(first + i) for i in range(rows_per_replica))))
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        return {k: v.to(self.settings.device) for k, v in batch.items()}
