"""Prompts: the built-in set (package data) and prompt files, one reader for both, and
encoding through a tokenizer.

``builtin_prompts()`` returns the 48 prompts written for this project
(``specdec/data/prompts.jsonl``, shipped as package data), eight of each kind in
``KINDS``: multi-turn chat, translation, summarisation (of passages written here, from a
few sentences to about 400 words), question answering, math word problems, and
retrieval-augmented answering (one to three short documents, then a question). Their
lengths range from a handful of words to several hundred. The list interleaves the kinds
(chat, translation, summarization, qa, math, rag, chat, ...), so any prefix of eight or
more prompts covers all six kinds and a mix of lengths. The English is deliberately plain:
the default target is a 135M-parameter instruct model. ``long_prompts()`` joins them
into prompts past a 512-token sliding window (kind ``"long"``).

``load_jsonl(path)`` reads that file and any prompt file (``specdec generate --jsonl``,
``specdec audit --prompts``). Each line is one of:

- a conversation: ``{"messages": [{"role": "user", "content": "..."}, ...], "id": ...,
  "kind": ...}``; roles ``system``, ``user``, ``assistant``; it ends on a user message;
- a plain prompt: ``{"prompt": "...", "id": ..., "kind": ...}``, one user message;
- a SpecBench question: ``{"question_id": 81, "category": "writing", "turns": ["...",
  ...]}``: the category becomes the kind and the question_id the id. Every turn is kept,
  each as a user message in order. SpecBench's later turns are follow-ups asked after the
  model's own answer to the earlier ones, which the file does not hold; so a multi-turn
  question is one conversation of consecutive user messages, and the model answers its
  turns together (``encode`` joins consecutive messages of one role, see below).

``id`` and ``kind`` are optional (defaults ``line-N`` and ``"custom"``). Blank lines are
skipped; any other line that breaks the format raises ValueError naming the file, the
line number and the rule.

``encode(prompts, tokenizer)`` turns prompts into token-id lists through the tokenizer's
chat template (with the generation prompt appended), or, for a tokenizer without one,
through plain text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

KINDS = ("chat", "translation", "summarization", "qa", "math", "rag")
ROLES = ("system", "user", "assistant")

JSONL_RULE = ("each line must be a JSON object with 'messages' (a non-empty list of "
              "{'role': 'system'|'user'|'assistant', 'content': a string}, ending on a "
              "user message), 'turns' (a non-empty list of strings) or 'prompt' (a string)")


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat-template messages (roles ``ROLES``), ending on a user message."""

    id: str
    kind: str
    messages: tuple[dict, ...]

    @property
    def text(self) -> str:
        """All message contents, separated by blank lines."""
        return "\n\n".join(m["content"] for m in self.messages)

    def word_count(self) -> int:
        """Whitespace-separated words over all messages."""
        return sum(len(m["content"].split()) for m in self.messages)


def builtin_prompts() -> list[Prompt]:
    """The 48 built-in prompts, kinds interleaved: chat-01, translation-01, ..., rag-01, chat-02, ..."""
    with resources.as_file(resources.files(__package__) / "data" / "prompts.jsonl") as path:
        return load_jsonl(path)


def long_prompts(count: int = 8, min_words: int = 440, step_words: int = 22) -> list[Prompt]:
    """``count`` long single-turn prompts built from the built-in texts, for models with a
    sliding window (Gemma 3's is 512 tokens): prompt i is a run of notes, the built-in
    prompts from the (5 i)-th on, cut at ``min_words + i step_words`` words (Gemma 3's
    tokenizer makes about 1.3 tokens of a word: 550 to 780 tokens for the defaults), then
    one question about the first note. Lengths differ row to row (mixed padding in one
    batch) and all lie past the window."""
    base = builtin_prompts()
    out = []
    for i in range(count):
        want = min_words + i * step_words
        notes, words, j = [], 0, 5 * i
        while words < want:
            text = base[j % len(base)].text.split()[: want - words]
            notes.append(f"Note {len(notes) + 1}: " + " ".join(text))
            words += len(text)
            j += 1
        text = "\n\n".join(notes + ["Question: in one sentence, what is note 1 about?"])
        out.append(Prompt(id=f"long-{i + 1:02d}", kind="long",
                          messages=({"role": "user", "content": text},)))
    return out


def prompt_set(name_or_path=None) -> list[Prompt]:
    """A prompt set by name or file: None or ``"builtin"`` -> ``builtin_prompts()``;
    ``"long"`` -> ``long_prompts()``; anything else is a JSONL file (``load_jsonl``)."""
    if name_or_path in (None, "builtin"):
        return builtin_prompts()
    if name_or_path == "long":
        return long_prompts()
    return load_jsonl(name_or_path)


def load_jsonl(path) -> list[Prompt]:
    """Prompts from a JSON-lines file (see the module docstring for the line formats).
    A missing file, a directory and a file that is not UTF-8 text raise ValueError (or
    OSError) naming the path."""
    from .validation import read_text

    path = Path(path)
    prompts = []
    for lineno, line in enumerate(read_text(path, "prompt file").split("\n"), 1):
        if line.strip():
            prompts.append(_record(line, f"{path}:{lineno}", lineno))
    return prompts


def _record(line: str, where: str, lineno: int) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}); {JSONL_RULE}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a JSON object; {JSONL_RULE}")
    if "messages" in obj:
        messages = _messages(obj["messages"], where)
        pid, kind = obj.get("id"), obj.get("kind")
    elif "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: bad 'turns' {turns!r:.60}; {JSONL_RULE}")
        messages = tuple({"role": "user", "content": t} for t in turns)
        pid, kind = obj.get("question_id"), obj.get("category")
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"{where}: bad 'prompt' {obj['prompt']!r:.60}; {JSONL_RULE}")
        messages = ({"role": "user", "content": obj["prompt"]},)
        pid, kind = obj.get("id"), obj.get("kind")
    else:
        raise ValueError(f"{where}: neither 'messages', 'turns' nor 'prompt'; {JSONL_RULE}")
    return Prompt(id=str(pid) if pid is not None else f"line-{lineno}",
                  kind=str(kind) if kind else "custom", messages=messages)


def _messages(messages, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: bad 'messages' (empty or not a list); {JSONL_RULE}")
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in ROLES
                or not isinstance(m["content"], str)):
            raise ValueError(f"{where}: bad message {i} {m!r:.60}; {JSONL_RULE}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message is {messages[-1]['role']!r}, not 'user' "
                         f"(the model answers the conversation); {JSONL_RULE}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def joined(messages) -> list[dict]:
    """The messages with consecutive messages of one role joined by a blank line: chat
    templates such as Gemma's and Mistral's require alternating roles. A conversation
    that alternates (every built-in one) comes back unchanged."""
    out: list = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def plain_text(messages) -> str:
    """A prompt as plain text, for tokenizers without a chat template: a single message
    as is; several as "User: ..." / "Assistant: ..." paragraphs ending on "Assistant:"."""
    if len(messages) == 1:
        return messages[0]["content"]
    label = {"user": "User", "assistant": "Assistant", "system": "System"}
    lines = [f"{label.get(m['role'], m['role'])}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


def encode(prompts, tokenizer) -> list[list[int]]:
    """Token ids of each prompt, ready for generation.

    With a chat template: ``apply_chat_template(joined(messages),
    add_generation_prompt=True)``. Without one: ``plain_text(messages)``, tokenized with
    the special tokens the tokenizer adds by itself (Gemma's beginning-of-text token; none
    for SmolLM2's).
    """
    from .validation import tokenizer_ids

    has_template = bool(getattr(tokenizer, "chat_template", None))
    result = []
    for p in prompts:
        if has_template:
            out = tokenizer.apply_chat_template(joined(p.messages), add_generation_prompt=True)
        else:
            out = tokenizer(plain_text(p.messages))
        result.append(tokenizer_ids(out))
    return result
