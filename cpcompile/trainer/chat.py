"""Instruction data as token ids and labels: the loss falls only on what the model is to write.

- A conversation (`data.source: chat`): a `messages` list of `{role, content}` rendered by the
  tokenizer's chat template. Labels (the ids; -100 elsewhere) on each assistant message's content
  and on the turn's close: the template's text after the content up to and including the first
  special token (`<|im_end|>`, `<|eot_id|>`, `</s>`), which the model must learn to emit to stop.
  System and user messages and the template's own text (role headers, a default system prompt,
  an empty think block it inserts) are -100.
- A prompt/completion pair (`data.source: prompt_completion`): no template; the prompt's ids (as a
  document opens: with the tokenizer's BOS, if it adds one), then the completion's, then EOS,
  each tokenized alone, as at inference the prompt is. Labels on the completion and the EOS.

Each sample ends with the tokenizer's EOS (a conversation's is appended unless its rendering
already ends with it, and has label -100: it is not the assistant's).

How the assistant's tokens are found: the template renders the conversation once as it is and
once with each content replaced by a marker. The text between markers is the template's own, so
the real rendering must be those pieces with the real contents put back; that is checked
character for character, and gives each content's exact span. The tokens (of the rendering,
tokenized once, as `apply_chat_template` does) are labelled by where their first character lies
(the fast tokenizer's offsets). Rendering growing prefixes of the conversation and diffing them
does not work for ordinary templates: Qwen3's renders the last assistant turn with an empty think
block that an earlier turn lacks, and Qwen3.5's generation prompt opens a think block that a
rendered past turn does not hold, so a prefix's rendering is not a prefix of the whole one. A
template that rewrites contents (strips whitespace, moves a `<think>` part elsewhere) is refused,
naming the record, rather than guessed at.
"""
from __future__ import annotations

from typing import NamedTuple

from ..batch import IGNORE_INDEX
from ..errors import PlanError, short_repr

MESSAGE_KEYS = ("role", "content")


class Sample(NamedTuple):
    """One document: token ids, and labels (the id where the loss counts it, else -100)."""

    ids: list[int]
    labels: list[int]


def pair_sample(tokenizer, prompt: str, completion: str) -> Sample:
    prompt_ids = tokenizer.ids(prompt)
    completion_ids = tokenizer.ids(completion, opening=False) + [tokenizer.eos_id]
    return Sample(prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids)


def conversation_sample(tokenizer, messages, where: str) -> Sample:
    """`messages` rendered by `tokenizer`'s chat template, labelled on the assistant's turns."""
    check_messages(messages, where)
    text, spans = render_with_assistant_spans(tokenizer, messages, where)
    encoded = tokenizer.hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [token if any(start <= first < end for start, end in spans) else IGNORE_INDEX
              for token, (first, _) in zip(ids, encoded["offset_mapping"])]
    if ids[-1] != tokenizer.eos_id:
        ids.append(tokenizer.eos_id)
        labels.append(IGNORE_INDEX)
    return Sample(ids, labels)


def check_messages(messages, where: str) -> None:
    """A non-empty list of `{role, content}` string pairs with at least one assistant message."""
    if not isinstance(messages, list) or not messages:
        raise PlanError("data.path", f"{where}: 'messages' must be a non-empty list of {{role, content}}, got "
                                     f"{short_repr(messages)}")
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PlanError("data.path", f"{where}: message {number} is not a {{role, content}} object: "
                                         f"{short_repr(message)}")
        for key in MESSAGE_KEYS:
            if not isinstance(message.get(key), str):
                raise PlanError("data.path", f"{where}: message {number} needs a string {key!r}, got "
                                             f"{short_repr(message.get(key))}")
        # a template would render other keys (tool_calls, reasoning_content) where no label rule reaches
        other = sorted(k for k, v in message.items() if k not in MESSAGE_KEYS and v is not None)
        if other:
            raise PlanError("data.path", f"{where}: message {number} has keys {short_repr(other)}; only role and "
                                         "content are read")
    if not any(message["role"] == "assistant" for message in messages):
        raise PlanError("data.path", f"{where}: the conversation has no assistant message: nothing to train on")


def render_with_assistant_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendering, [(start, end)] of each assistant turn's labelled characters in it)."""
    text = _render(tokenizer, messages, where)
    markers = [f"<cpcompile-content-{number}>" for number in range(len(messages))]
    marked = _render(tokenizer, [{**m, "content": marker} for m, marker in zip(messages, markers)], where)
    pieces = _template_pieces(marked, markers, where)
    specials = tokenizer.special_texts()
    rebuilt, spans = pieces[0], []
    for number, message in enumerate(messages):
        after = pieces[number + 1]
        if message["role"] == "assistant":
            close = _turn_close(after, specials, where, number)
            spans.append((len(rebuilt), len(rebuilt) + len(message["content"]) + close))
        rebuilt += message["content"] + after
    if rebuilt != text:
        raise PlanError("data.path", f"{where}: the chat template changes a message's content (first difference "
                                     f"at character {_first_difference(rebuilt, text)}: it strips or rewrites "
                                     "it), so the assistant's tokens cannot be told apart; clean the contents "
                                     "(e.g. strip their whitespace) or use another template")
    return text, spans


def _render(tokenizer, messages: list[dict], where: str) -> str:
    try:
        return tokenizer.hf.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # a template raises what it likes (jinja2's TemplateError, raise_exception)
        raise PlanError("data.path", f"{where}: the chat template refused the conversation: "
                                     f"{type(exc).__name__}: {exc}") from exc


def _template_pieces(marked: str, markers: list[str], where: str) -> list[str]:
    """The template's text before, between and after the contents (len(markers) + 1 pieces)."""
    pieces, rest = [], marked
    for number, marker in enumerate(markers):
        if marked.count(marker) != 1 or marker not in rest:
            raise PlanError("data.path", f"{where}: the chat template does not print every message's content "
                                         f"once and in order (message {number}), so the assistant's tokens cannot "
                                         "be found")
        before, rest = rest.split(marker)
        pieces.append(before)
    return pieces + [rest]


def _turn_close(after: str, specials: list[str], where: str, number: int) -> int:
    """How many characters of the template's text after an assistant content close its turn: up to
    and including the first special token."""
    found = [(after.find(special), -len(special)) for special in specials if special in after]
    if not found:
        raise PlanError("data.path", f"{where}: the chat template closes assistant message {number} with no "
                                     f"special token ({short_repr(after)}): the model could not learn to stop")
    start, minus_length = min(found)  # the earliest; of two there, the longer (the tokenizer matches it)
    return start - minus_length


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
