"""The trainer's data: one global batch of `batch_size` rows per step, split over the replicas.

Row `i` of the whole stream is a pure function of (seed, i), so the data position is just the
step: step `s` holds rows `[s * batch_size, (s + 1) * batch_size)`, and data-parallel replica `r`
of `dp` reads the `r`-th equal part of them. Every CP rank of a replica reads the same rows (the
batch contract of `shard_batch`, which then cuts this rank's slice). A run resumed at step `s`,
with any number of replicas, reads what the uninterrupted run would have read.

Sources: `synthetic` (random token ids), or a local file of samples, each one document:

- `text`: documents separated by blank lines; `jsonl`: one record a line, its `text_field`
  (or the rows of a Parquet file, its `text_field` column). Labels on every token;
- `chat`: records with a `messages` list, rendered by `data.tokenizer`'s chat template, labels on
  the assistant's turns only; `prompt_completion`: records with `prompt` and `completion`, labels
  on the completion only (`chat.py` says which tokens exactly).

Records are JSON lines, or a Parquet file's rows when `data.path` ends in `.parquet` (`records.py`).
Text is tokenized by `data.tokenizer` (a local tokenizer folder), else by `ByteTokenizer` (UTF-8
bytes); every document ends with the tokenizer's EOS (`tokenizer.py`). Without packing, a row
holds one document (cycled in file order), cut to `seq_len` tokens (its tail dropped) or
right-padded (attention mask 0, label -100).

With packing (`data.packing: true`) a row is `seq_len` tokens of documents laid end to end, with
`position_ids` restarting at 0 at every document and no padding (`documents.py`, docs/batch.md):

- a file: its documents in file order, cycled, as one endless token stream; row `i` is tokens
  `[i * seq_len, (i + 1) * seq_len)` of it. A document that overflows a row is split, not moved:
  its rest opens the next row as a document of its own (positions from 0 again), so no token is
  dropped or padded;
- synthetic: random token ids (the same as without packing) cut into documents of random lengths
  (uniform in 1..seq_len/2, drawn from the row's own generator), so rows hold several documents,
  some shorter than a GDN conv kernel.

A packed batch's labels are the samples' labels with -100 at every document's first token: after
the shift, the last token of a document predicts nothing (`shard_batch` enforces the same), and
the loss is the mean over the real targets only.
"""
from __future__ import annotations

import torch

from ..batch import IGNORE_INDEX
from ..documents import positions_from_starts
from ..errors import PlanError
from .chat import Sample, conversation_sample, pair_sample
from .config import DataSettings, TrainSettings
from .records import read_records, read_text, string_field
from .tokenizer import tokenizer_for

# The record keys (and Parquet columns) each record source reads.
COLUMNS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion")}


def read_documents(data: DataSettings) -> list[str]:
    """The documents of a `text` file (blank-line separated) or of `jsonl` records (`text_field`)."""
    if data.source == "text":
        documents = [doc.strip() for doc in read_text(data.path).split("\n\n")]
    else:
        records = read_records(data.path, (data.text_field,))
        documents = [string_field(record, data.text_field, where) for where, record in records]
    documents = [doc for doc in documents if doc]  # empty documents hold no token to train on
    if not documents:
        raise PlanError("data.path", f"{data.path} holds no document")
    return documents


def read_samples(data: DataSettings, tokenizer) -> list[Sample]:
    """The file's samples, tokenized, with their labels."""
    if data.source in ("text", "jsonl"):
        return [Sample(ids, ids) for ids in map(tokenizer.encode, read_documents(data))]
    records = read_records(data.path, COLUMNS[data.source])
    if not records:
        raise PlanError("data.path", f"{data.path} holds no record")
    if data.source == "chat":
        return [conversation_sample(tokenizer, record.get("messages"), where) for where, record in records]
    return [pair_sample(tokenizer, string_field(record, "prompt", where), string_field(record, "completion", where))
            for where, record in records]


class TokenStream:
    """Rows of the global data stream, by index; `batch(step, replica, replicas)` is what one
    data-parallel replica trains on at one step."""

    def __init__(self, data: DataSettings, settings: TrainSettings, vocab_size: int):
        self.settings = settings
        self.vocab_size = vocab_size
        self.packing = data.packing
        self.samples = None
        if data.source != "synthetic":
            tokenizer = tokenizer_for(data, vocab_size)
            self.samples = read_samples(data, tokenizer)
            self.pad_id = tokenizer.eos_id
            if self.packing:
                self.tokens, self.labels, self.starts = _concatenate(self.samples)

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids, attention mask, labels) of global row `index`, each [seq_len]."""
        seq_len = self.settings.seq_len
        if self.samples is None:
            gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + index)
            ids = torch.randint(0, self.vocab_size, (seq_len,), generator=gen)
            return ids, torch.ones_like(ids), ids
        sample = self.samples[index % len(self.samples)]
        length = min(len(sample.ids), seq_len)
        ids = torch.full((seq_len,), self.pad_id, dtype=torch.long)
        ids[:length] = torch.tensor(sample.ids[:length], dtype=torch.long)
        labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
        labels[:length] = torch.tensor(sample.labels[:length], dtype=torch.long)
        mask = torch.zeros(seq_len, dtype=torch.long)
        mask[:length] = 1
        return ids, mask, labels

    def packed_row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids, position ids restarting at 0 per document, labels) of packed global row `index`."""
        seq_len = self.settings.seq_len
        if self.samples is None:
            gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + index)
            ids = torch.randint(0, self.vocab_size, (seq_len,), generator=gen)
            lengths = torch.randint(1, max(1, seq_len // 2) + 1, (seq_len,), generator=gen)
            starts = torch.zeros(seq_len, dtype=torch.bool)
            ends = lengths.cumsum(0)
            starts[ends[ends < seq_len]] = True
            labels = ids
        else:
            where = (index * seq_len + torch.arange(seq_len)) % self.tokens.numel()
            ids, labels, starts = self.tokens[where], self.labels[where], self.starts[where]
        starts[0] = True  # a row opens with a document, also the rest of one split at the row boundary
        return ids, positions_from_starts(starts), labels.masked_fill(starts, IGNORE_INDEX)

    def batch(self, step: int, replica: int = 0, replicas: int = 1) -> dict[str, torch.Tensor]:
        """The global batch of one replica at `step` (0-based): input_ids, attention_mask, labels;
        packed: input_ids, position_ids, labels (no attention mask: nothing is padded)."""
        rows_per_replica = self.settings.batch_size // replicas
        first = step * self.settings.batch_size + replica * rows_per_replica
        rows = range(first, first + rows_per_replica)
        if self.packing:
            ids, positions, labels = _stack(self.packed_row(i) for i in rows)
            batch = {"input_ids": ids, "position_ids": positions, "labels": labels}
        else:
            ids, mask, labels = _stack(self.row(i) for i in rows)
            batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        return {k: v.to(self.settings.device) for k, v in batch.items()}


def _stack(rows) -> tuple[torch.Tensor, ...]:
    """[(a, b, ...), ...] rows -> (stacked a, stacked b, ...)."""
    return tuple(torch.stack(column) for column in zip(*rows))


def _concatenate(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(every token in order, their labels, whether each starts a document): one pass over a file's samples."""
    tokens = torch.tensor([t for sample in samples for t in sample.ids], dtype=torch.long)
    labels = torch.tensor([t for sample in samples for t in sample.labels], dtype=torch.long)
    starts = torch.zeros(tokens.numel(), dtype=torch.bool)
    starts[torch.tensor([0] + [len(sample.ids) for sample in samples[:-1]]).cumsum(0)] = True
    return tokens, labels, starts
