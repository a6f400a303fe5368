"""A real tokenizer (`data.tokenizer`) and instruction data (`data.source: chat | prompt_completion`,
JSON lines or Parquet): cpcompile/trainer/{tokenizer,chat,records,data}.py.

The tokenizer is the tiny offline one of `tokenizer_folder.py` (byte-level BPE, a Qwen-shaped chat
template). Unit tests of the label masks, token by token against a hand-written rendering; EOS
between packed documents; Parquet rows equal to JSON lines; one test per refusal; then a packed
chat run at cp 2 (gloo, float64, GDN State-P2P + SDPA AllGather) against the same run in one
process without a plan."""
from __future__ import annotations

import json
import random

import pytest
import torch

from dist_utils import run_distributed
from gdn_harness import TWO_LAYERS
from test_trainer import STEP_1_RTOL, _close, _curves, _run, qwen3_5_config, without_cp
from tokenizer_folder import DEFAULT_SYSTEM, EOS, VOCAB_SIZE, write_tokenizer_folder

IGNORE = -100
WORDS = ("two", "plus", "is", "four", "hello", "world", "the", "user", "asks", "tiny", "answers", "what")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tokenizer_folder(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _write(path, records: list[dict]):
    """`records` as JSON lines, or as a Parquet file when `path` ends in .parquet."""
    if str(path).endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), str(path))
    else:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def _stream(path: str, source: str, tokenizer: str | None, seq_len: int = 96, batch_size: int = 2,
            packing: bool = False, vocab_size: int = VOCAB_SIZE):
    from cpcompile.trainer.config import DataSettings, TrainSettings
    from cpcompile.trainer.data import TokenStream

    data = DataSettings(source=source, path=path, tokenizer=tokenizer, packing=packing)
    return TokenStream(data, TrainSettings(seq_len=seq_len, batch_size=batch_size), vocab_size)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def _conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": _sentence(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": _sentence(rng)}, {"role": "assistant", "content": _sentence(rng)}]
    return {"messages": messages}


# --------------------------------------------------------------------------- label masks

TWO_TURNS = [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."},
             {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]
# The rendering of TWO_TURNS by the fixture's template, by hand: (text, trained). The default system
# prompt, the headers and the last turn's empty think block are the template's; each assistant
# content and its <|im_end|> are trained; the newline after <|im_end|> is not.
TWO_TURNS_RENDERED = [
    (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nwhat is two plus two?<|im_end|>\n"
     "<|im_start|>assistant\n", False),
    ("four.<|im_end|>", True),
    ("\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("hello world<|im_end|>", True),
    ("\n", False),
]
WITH_SYSTEM = [{"role": "system", "content": "answers in a few words"}, {"role": "user", "content": "hello"},
               {"role": "assistant", "content": "world, hello"}]
WITH_SYSTEM_RENDERED = [
    ("<|im_start|>system\nanswers in a few words<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
     "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("world, hello<|im_end|>", True),
    ("\n", False),
]


@pytest.mark.parametrize("messages, rendered", [(TWO_TURNS, TWO_TURNS_RENDERED),
                                                (WITH_SYSTEM, WITH_SYSTEM_RENDERED)], ids=["two-turns", "system"])
def test_chat_labels_fall_on_the_assistant_contents_and_their_turn_ends_token_by_token(tmp_path, folder, hf,
                                                                                       messages, rendered):
    """One conversation a row (no packing): its ids are the hand-written rendering's, then the EOS
    (label -100); token by token, a label is the id exactly where the token's first character lies
    in an assistant content or its closing <|im_end|>, and every such part starts and ends on a
    token boundary."""
    text = "".join(part for part, _ in rendered)
    assert hf.apply_chat_template(messages, tokenize=False) == text  # the hand rendering is the template's
    stream = _stream(_write(tmp_path / "chat.jsonl", [{"messages": messages}]), "chat", folder, batch_size=1)
    batch = stream.batch(0)
    length = int(batch["attention_mask"][0].sum())
    ids, labels = batch["input_ids"][0, :length].tolist(), batch["labels"][0, :length].tolist()
    assert ids == hf(text, add_special_tokens=False)["input_ids"] + [hf.convert_tokens_to_ids(EOS)]
    trained_chars, boundaries, position = set(), set(), 0
    for part, trained in rendered:
        boundaries |= {position, position + len(part)}
        if trained:
            trained_chars |= set(range(position, position + len(part)))
        position += len(part)
    starts, position = [], 0
    for token in ids[:-1]:
        starts.append(position)
        position += len(hf.decode([token]))
    assert position == len(text) and boundaries <= set(starts) | {len(text)}
    expected = [token if start in trained_chars else IGNORE for token, start in zip(ids, starts)] + [IGNORE]
    assert labels == expected
    assert hf.decode([t for t in labels if t != IGNORE]) == "".join(p for p, trained in rendered if trained)


def test_prompt_completion_labels_fall_on_the_completion_and_eos(tmp_path, folder, hf):
    """Prompt and completion tokenized each alone, then the EOS; labels on the completion and EOS."""
    records = [{"prompt": "what is two plus two?", "completion": " four."}, {"prompt": "hello", "completion": " world"}]
    batch = _stream(_write(tmp_path / "pairs.jsonl", records), "prompt_completion", folder, seq_len=16).batch(0)
    eos = hf.convert_tokens_to_ids(EOS)
    for row, record in enumerate(records):
        prompt = hf(record["prompt"])["input_ids"]
        completion = hf(record["completion"], add_special_tokens=False)["input_ids"] + [eos]
        length = len(prompt) + len(completion)
        assert batch["input_ids"][row, :length].tolist() == prompt + completion
        assert batch["labels"][row].tolist() == [IGNORE] * len(prompt) + completion + [IGNORE] * (16 - length)


def test_the_byte_tokenizer_reads_prompt_completion_without_a_tokenizer_folder(tmp_path):
    batch = _stream(_write(tmp_path / "pairs.jsonl", [{"prompt": "ab", "completion": "c"}]), "prompt_completion",
                    None, seq_len=6, batch_size=1, vocab_size=257).batch(0)
    assert batch["input_ids"].tolist() == [[97, 98, 99, 256, 256, 256]]
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 99, 256, IGNORE, IGNORE]]


def test_packed_text_documents_are_separated_by_the_tokenizers_eos(tmp_path, folder, hf):
    """data.tokenizer on a text file, packed: each document's ids, then its EOS, end to end;
    positions restart after every EOS; labels are the ids but at each document's first token."""
    docs = ["hello world", "two plus two is four", "the user asks"]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(docs))
    eos = hf.convert_tokens_to_ids(EOS)
    flat = [t for doc in docs for t in hf(doc)["input_ids"] + [eos]]
    batch = _stream(str(path), "text", folder, seq_len=len(flat), batch_size=1, packing=True).batch(0)
    ids, positions = batch["input_ids"][0], batch["position_ids"][0]
    assert ids.tolist() == flat
    assert (positions == 0).nonzero().flatten().tolist() == [0] + [i + 1 for i in (ids == eos).nonzero().flatten()
                                                                   .tolist()[:-1]]
    assert torch.equal(batch["labels"][0], ids.masked_fill(positions == 0, IGNORE))


def test_packed_conversations_keep_their_labels_and_restart_positions(tmp_path, folder):
    """Conversations laid end to end (split at row ends, as long documents are): each row's labels
    are the conversations' labels, -100 at every document start (a split rest's too)."""
    from cpcompile.trainer.chat import conversation_sample
    from cpcompile.trainer.tokenizer import load_tokenizer

    rng = random.Random(0)
    records = [_conversation(rng) for _ in range(4)]
    stream = _stream(_write(tmp_path / "chat.jsonl", records), "chat", folder, seq_len=40, batch_size=2, packing=True)
    tokenizer = load_tokenizer(folder, VOCAB_SIZE, chat=True)
    samples = [conversation_sample(tokenizer, r["messages"], "") for r in records]
    ids = [t for s in samples for t in s.ids]
    labels = [t for s in samples for t in s.labels]
    for step in range(3):
        batch = stream.batch(step)
        for row in range(2):
            where = [((step * 2 + row) * 40 + k) % len(ids) for k in range(40)]
            starts = batch["position_ids"][row] == 0
            assert batch["input_ids"][row].tolist() == [ids[w] for w in where]
            assert batch["labels"][row].tolist() == [IGNORE if s else labels[w] for w, s in zip(where, starts)]


@pytest.mark.parametrize("source", ["jsonl", "chat", "prompt_completion"])
@pytest.mark.parametrize("packing", [False, True])
def test_parquet_rows_equal_json_lines(tmp_path, folder, source, packing):
    rng = random.Random(1)
    records = {"jsonl": lambda: {"text": _sentence(rng)}, "chat": lambda: _conversation(rng),
               "prompt_completion": lambda: {"prompt": _sentence(rng), "completion": _sentence(rng)}}[source]
    records = [records() for _ in range(5)]
    lines = _stream(_write(tmp_path / "data.jsonl", records), source, folder, seq_len=32, packing=packing)
    rows = _stream(_write(tmp_path / "data.parquet", records), source, folder, seq_len=32, packing=packing)
    for step in range(3):
        a, b = lines.batch(step), rows.batch(step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- refusals


def _chat_config(tmp_path, folder: str, **data) -> dict:
    from gdn_harness import TEXT

    path = _write(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    return {"model": {"model_type": "qwen3_5_text", **TEXT, "vocab_size": VOCAB_SIZE},
            "train": {"steps": 1, "seq_len": 32, "batch_size": 1},
            "data": {"source": "chat", "path": path, "tokenizer": folder, **data}}


def _broken_folder(tmp_path, **kwargs) -> str:
    return write_tokenizer_folder(tmp_path / "broken", **kwargs)


def _corrupt_folder(tmp_path) -> str:
    folder = _broken_folder(tmp_path)
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    return folder


CONFIG_REFUSALS = {
    "no-such-folder": (lambda tmp, c: c["data"].update(tokenizer=str(tmp / "nothing")), "data.tokenizer",
                       "no such folder"),
    "no-tokenizer-file": (lambda tmp, c: c["data"].update(tokenizer=str(tmp)), "data.tokenizer",
                          "holds neither tokenizer.json"),
    "unreadable": (lambda tmp, c: c["data"].update(tokenizer=_corrupt_folder(tmp)), "data.tokenizer",
                   "transformers cannot load a tokenizer"),
    "no-eos": (lambda tmp, c: c["data"].update(tokenizer=_broken_folder(tmp, eos=None)), "data.tokenizer",
               "has no EOS token"),
    "vocab-too-small": (lambda tmp, c: c["model"].update(vocab_size=VOCAB_SIZE - 1), "data.tokenizer",
                        f"ids up to {VOCAB_SIZE - 1}, beyond the model's vocab_size {VOCAB_SIZE - 1}"),
    "no-chat-template": (lambda tmp, c: c["data"].update(tokenizer=_broken_folder(tmp, chat_template=None)),
                         "data.tokenizer", "has no chat template"),
    "chat-without-tokenizer": (lambda tmp, c: c["data"].pop("tokenizer"), "data.tokenizer",
                               "data.source chat renders each conversation"),
    "synthetic-with-tokenizer": (lambda tmp, c: c["data"].update(source="synthetic", path=None), "data.tokenizer",
                                 "synthetic data tokenizes nothing"),
    "text-from-parquet": (lambda tmp, c: c["data"].update(source="text", path=_write(tmp / "t.parquet",
                                                                                    [{"text": "x"}])),
                          "data.source", "a Parquet text column is data.source jsonl"),
    "not-parquet": (lambda tmp, c: (tmp / "fake.parquet").write_text("text") and
                    c["data"].update(path=str(tmp / "fake.parquet")), "data.path", "is not a Parquet file"),
    "unknown-source": (lambda tmp, c: c["data"].update(source="conversations"), "data.source", "must be one of"),
}


@pytest.mark.parametrize("name", list(CONFIG_REFUSALS))
def test_a_config_refusal_names_its_field(tmp_path, folder, name):
    """Each is one line before any process starts (load_train_config)."""
    from cpcompile.errors import PlanError
    from cpcompile.trainer import load_train_config

    edit, field, words = CONFIG_REFUSALS[name]
    config = _chat_config(tmp_path, folder)
    edit(tmp_path, config)
    with pytest.raises(PlanError) as info:
        load_train_config(config)
    assert info.value.field == field and words in info.value.reason, info.value


TRIMMING_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content | trim + "
                     "'<|im_end|>\\n' }}{%- endfor %}")
PLAIN_CLOSE_TEMPLATE = "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
TWICE_TEMPLATE = "{%- for m in messages %}{{- m.content + '<|im_end|>' + m.content + '<|im_end|>' }}{%- endfor %}"
RAISING_TEMPLATE = "{{- raise_exception('roles must alternate') }}"
DATA_REFUSALS = {
    "messages-not-a-list": ({"messages": "hello"}, None, "'messages' must be a non-empty list"),
    "no-messages": ({"text": "hello"}, None, "'messages' must be a non-empty list"),
    "message-not-an-object": ({"messages": ["hello"]}, None, "message 0 is not a {role, content} object"),
    "content-not-a-string": ({"messages": [{"role": "user", "content": 7}]}, None, "message 0 needs a string "
                                                                                   "'content'"),
    "extra-key": ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, None,
                  "message 0 has keys ['tool_calls']"),
    "no-assistant": ({"messages": [{"role": "user", "content": "hello"}]}, None, "no assistant message"),
    "trimmed-content": ({"messages": [{"role": "assistant", "content": " four "}]}, TRIMMING_TEMPLATE,
                        "the chat template changes a message's content"),
    "no-special-close": ({"messages": TWO_TURNS}, PLAIN_CLOSE_TEMPLATE, "closes assistant message 1 with no special"),
    "content-twice": ({"messages": TWO_TURNS}, TWICE_TEMPLATE, "does not print every message's content once"),
    "template-raises": ({"messages": TWO_TURNS}, RAISING_TEMPLATE, "the chat template refused the conversation: "
                                                                   "TemplateError: roles must alternate"),
}


@pytest.mark.parametrize("name", list(DATA_REFUSALS))
def test_a_conversation_the_labels_cannot_serve_is_refused_naming_its_line(tmp_path, name):
    from cpcompile.errors import PlanError

    record, template, words = DATA_REFUSALS[name]
    records = [record] if template else [{"messages": WITH_SYSTEM}, record]  # a good line first, when it is
    folder = write_tokenizer_folder(tmp_path / "tok", **({"chat_template": template} if template else {}))
    with pytest.raises(PlanError) as info:
        _stream(_write(tmp_path / "chat.jsonl", records), "chat", folder)
    line = f"line {len(records)}"
    assert info.value.field == "data.path" and info.value.reason.startswith(line) and words in info.value.reason, \
        info.value


@pytest.mark.parametrize("line, words", [('{"prompt": "a"}', "line 1 is not a JSON object with a string 'completion'"),
                                         ('{"prompt": "a", "completion": 3}', "line 1: 'completion' is of type int"),
                                         ('{"prompt": "a", ', "line 1 is not a JSON object (Expecting"),
                                         ("", "holds no record")])
def test_a_prompt_completion_record_without_strings_is_refused_naming_its_line(tmp_path, line, words):
    from cpcompile.errors import PlanError

    (tmp_path / "pairs.jsonl").write_text(line + "\n")
    with pytest.raises(PlanError) as info:
        _stream(str(tmp_path / "pairs.jsonl"), "prompt_completion", None, vocab_size=257)
    assert info.value.field == "data.path" and words in info.value.reason, info.value


def test_a_parquet_file_pyarrow_cannot_read_is_refused_naming_it(tmp_path, folder):
    from cpcompile.errors import PlanError

    (tmp_path / "chat.parquet").write_bytes(b"PAR1 and then no Parquet at all")
    with pytest.raises(PlanError) as info:
        _stream(str(tmp_path / "chat.parquet"), "chat", folder)
    assert info.value.field == "data.path" and "pyarrow cannot read" in info.value.reason, info.value


def test_a_parquet_file_without_the_sources_column_is_refused_naming_it(tmp_path, folder):
    from cpcompile.errors import PlanError

    path = _write(tmp_path / "chat.parquet", [{"conversation": "hello"}])
    with pytest.raises(PlanError) as info:
        _stream(path, "chat", folder)
    assert info.value.field == "data.path" and "has no column 'messages'" in info.value.reason


# --------------------------------------------------------------------------- gloo runs


def _chat_run_config(seed: int, cp: int, path: str, folder: str) -> dict:
    config = qwen3_5_config(seed, cp=cp, batch_size=2, seq_len=64, steps=3, model=TWO_LAYERS)  # a region of each kind
    config["model"]["vocab_size"] = VOCAB_SIZE
    config["data"] = {"source": "chat", "path": path, "tokenizer": folder, "packing": True}
    return config


def _chat_run(rank: int, world: int, seed: int, path: str, folder: str) -> list[tuple]:
    config = _chat_run_config(seed, world, path, folder)
    return _curves(_run(config if world > 1 else without_cp(config)))


def test_a_packed_chat_run_at_cp_2_follows_the_run_without_a_plan(tmp_path, folder):
    """GDN State-P2P (eager) + SDPA AllGather at cp 2 on packed conversations (labels only on the
    assistant's turns, which `shard_batch` shifts across the rank boundary), float64: step 1's loss
    and gradient norm within `STEP_1_RTOL`, the 3 steps within 1e-6, of one process without a plan."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    path = _write(tmp_path / "chat.jsonl", [_conversation(rng) for _ in range(8)])
    cp2 = run_distributed(_chat_run, 2, seed, path, folder, timeout=300)
    alone = run_distributed(_chat_run, 1, seed, path, folder, timeout=300)[0]
    assert _close(cp2[0], cp2[1], 1e-12), cp2  # the ranks' loss agrees to rounding: each adds its own share
    assert _close(cp2[0][:1], alone[:1], STEP_1_RTOL) and _close(cp2[0], alone, 1e-6), (cp2[0], alone)
