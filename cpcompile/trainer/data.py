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

With packing (`data.packing: true`) a row is `seq_len` tokens of documents laid end to end, with
`position_ids` restarting at 0 at every document and no padding (`documents.py`, docs/batch.md):

- a file: its documents in file order, cycled, as one endless token stream; row `i` is tokens
  `[i * seq_len, (i + 1) * seq_len)` of it. A document that overflows a row is split, not moved:
  its rest opens the next row as a document of its own (positions from 0 again), so no token is
  dropped or padded;
- synthetic: random token ids (the same as without packing) cut into documents of random lengths
  (uniform in 1..seq_len/2, drawn from the row's own generator), so rows hold several documents,
  some shorter than a GDN conv kernel.

A packed batch's labels are the ids with -100 at every document's first token: after the shift,
the last token of a document predicts nothing (`shard_batch` enforces the same), and the loss is
the mean over the real targets only.
"""
from __future__ import annotations

import json

import torch

from ..batch import IGNORE_INDEX
from ..documents import positions_from_starts
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
    try:
        with open(data.path, encoding="utf-8") as handle:
            content = handle.read()
    except UnicodeDecodeError as exc:  # past the part the config checked (config.check_text_file)
        raise PlanError("data.path", f"{data.path} is not UTF-8 text (byte {exc.start})") from exc
    if data.source == "text":
        documents = [doc.strip() for doc in content.split("\n\n")]
    else:
        documents = []
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[data.text_field]
            except (ValueError, KeyError, TypeError) as exc:
                raise PlanError("data.path", f"line {number} is not a JSON object with a string "
                                             f"{data.text_field!r} ({exc!r})") from exc
            if not isinstance(text, str):
                raise PlanError("data.path", f"line {number}: {data.text_field!r} is of type {type(text).__name__}, "
                                             "not a string")
            documents.append(text)
    documents = [doc for doc in documents if doc]  # empty documents hold no token to train on
    if not documents:
        raise PlanError("data.path", f"{data.path} holds no document")
    return documents


class TokenStream:
    """Rows of the global data stream, by index; `batch(step, replica, replicas)` is what one
    data-parallel replica trains on at one step."""

    def __init__(self, data: DataSettings, settings: TrainSettings, vocab_size: int):
        self.settings = settings
        self.vocab_size = vocab_size
        self.packing = data.packing
        self.documents = None
        if data.source != "synthetic":
            tokenizer = ByteTokenizer()
            if vocab_size < tokenizer.vocab_size:
                raise PlanError("model.vocab_size", f"the byte tokenizer needs {tokenizer.vocab_size} token ids, the "
                                                    f"model has {vocab_size}")
            self.documents = [tokenizer.encode(doc) for doc in read_documents(data)]
            self.pad_id = tokenizer.eos_id
            if self.packing:
                self.tokens, self.starts = _concatenate(self.documents)

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

    def packed_row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, position ids restarting at 0 per document) of packed global row `index`."""
        seq_len = self.settings.seq_len
        if self.documents is None:
            gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + index)
            ids = torch.randint(0, self.vocab_size, (seq_len,), generator=gen)
            lengths = torch.randint(1, max(1, seq_len // 2) + 1, (seq_len,), generator=gen)
            starts = torch.zeros(seq_len, dtype=torch.bool)
            ends = lengths.cumsum(0)
            starts[ends[ends < seq_len]] = True
        else:
            where = (index * seq_len + torch.arange(seq_len)) % self.tokens.numel()
            ids, starts = self.tokens[where], self.starts[where]
        starts[0] = True  # a row opens with a document, also the rest of one split at the row boundary
        return ids, positions_from_starts(starts)

    def batch(self, step: int, replica: int = 0, replicas: int = 1) -> dict[str, torch.Tensor]:
        """The global batch of one replica at `step` (0-based): input_ids, attention_mask, labels;
        packed: input_ids, position_ids, labels (no attention mask: nothing is padded)."""
        rows_per_replica = self.settings.batch_size // replicas
        first = step * self.settings.batch_size + replica * rows_per_replica
        rows = range(first, first + rows_per_replica)
        if self.packing:
            ids, positions = _stack(self.packed_row(i) for i in rows)
            batch = {"input_ids": ids, "position_ids": positions,
                     "labels": ids.masked_fill(positions == 0, IGNORE_INDEX)}
        else:
            ids, mask = _stack(self.row(i) for i in rows)
            batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}
        return {k: v.to(self.settings.device) for k, v in batch.items()}


def _stack(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """[(a, b), ...] rows -> (stacked a, stacked b)."""
    first, second = zip(*rows)
    return torch.stack(first), torch.stack(second)


def _concatenate(documents: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(every token in order, whether each starts a document): one pass over a file's documents."""
    tokens = torch.tensor([t for doc in documents for t in doc], dtype=torch.long)
    starts = torch.zeros(tokens.numel(), dtype=torch.bool)
    starts[torch.tensor([0] + [len(doc) for doc in documents[:-1]]).cumsum(0)] = True
    return tokens, starts

