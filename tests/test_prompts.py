"""The built-in prompt set (package data), JSON-lines loading, and encoding with the real
tokenizer."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest

from specdec import models, prompts
from specdec.prompts import KINDS, Prompt, builtin_prompts, encode, load_jsonl


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2 tokenizer from the converted-model cache (no model load if present)."""
    path = models.cache_dir() / "smollm2-135m-instruct"
    if (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    return models.default_model()[1]


def test_at_least_48_prompts_eight_per_kind_unique_ids():
    ps = builtin_prompts()
    assert len(ps) >= 48
    assert set(KINDS) == {"chat", "translation", "summarization", "qa", "math", "rag"}
    counts = Counter(p.kind for p in ps)
    assert set(counts) == set(KINDS)
    assert all(counts[k] >= 8 for k in KINDS)
    assert len({p.id for p in ps}) == len(ps)
    assert all(isinstance(p, Prompt) and isinstance(p.messages, tuple) for p in ps)


def test_order_is_fixed_and_the_first_eight_cover_all_kinds():
    ps = builtin_prompts()
    assert [p.id for p in ps] == [p.id for p in builtin_prompts()]
    assert {p.kind for p in ps[:8]} == set(KINDS)
    first = [p.word_count() for p in ps[:8]]
    assert min(first) < 15 and max(first) > 150  # mixed lengths early on


def test_messages_are_well_formed():
    for p in builtin_prompts():
        assert p.messages, p.id
        for i, m in enumerate(p.messages):
            assert set(m) == {"role", "content"}, p.id
            assert m["role"] == ("user", "assistant")[i % 2], p.id
            assert isinstance(m["content"], str) and m["content"].strip(), p.id
        assert p.messages[-1]["role"] == "user", p.id


def test_chat_prompts_are_multi_turn_and_others_single_turn():
    for p in builtin_prompts():
        if p.kind == "chat":
            assert len(p.messages) >= 3 and p.messages[-1]["role"] == "user", p.id
        else:
            assert len(p.messages) == 1, p.id


def test_word_counts_spread_widely():
    words = [p.word_count() for p in builtin_prompts()]
    assert min(words) < 15
    assert max(words) > 250
    summ = [p.word_count() for p in builtin_prompts() if p.kind == "summarization"]
    assert min(summ) < 150 and sum(150 <= w <= 450 for w in summ) >= 3


def test_rag_prompts_have_documents_and_a_question():
    for p in builtin_prompts():
        if p.kind == "rag":
            text = p.messages[0]["content"]
            assert "Document 1:" in text and "Document 4:" not in text, p.id
            assert "Question:" in text, p.id


# ---------------------------------------------------------------- load_jsonl


def _write(tmp_path, lines, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_builtin_prompts_are_the_package_data_file_read_by_the_same_reader():
    from importlib import resources

    path = resources.files("specdec") / "data" / "prompts.jsonl"
    assert path.is_file()
    assert load_jsonl(path) == builtin_prompts()
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    assert all(set(x) == {"id", "kind", "messages"} for x in lines)


def test_builtin_prompts_ship_as_package_data():
    import tomllib
    from pathlib import Path

    cfg = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "data/*.jsonl" in cfg["tool"]["setuptools"]["package-data"]["specdec"]


def test_load_specbench_format_keeps_every_turn_and_the_category(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"question_id": 81, "category": "writing",
                    "turns": ["Write a poem about rain.", "Now make it shorter."]}),
        "",
        json.dumps({"question_id": 82, "category": "math_reasoning",
                    "turns": ["What is 2 + 2?"]}),
    ])
    ps = load_jsonl(path)
    assert [p.id for p in ps] == ["81", "82"]
    assert [p.kind for p in ps] == ["writing", "math_reasoning"]
    assert ps[0].messages == ({"role": "user", "content": "Write a poem about rain."},
                              {"role": "user", "content": "Now make it shorter."})
    assert ps[1].messages == ({"role": "user", "content": "What is 2 + 2?"},)


def test_load_messages_format(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    path = _write(tmp_path, [json.dumps({"messages": chat, "id": "c1", "kind": "chat"}),
                             json.dumps({"messages": chat[1:2]})])
    ps = load_jsonl(path)
    assert ps[0] == Prompt(id="c1", kind="chat", messages=tuple(chat))
    assert ps[1].kind == "custom" and ps[1].id == "line-2"


def test_load_plain_prompt_format(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"prompt": "Hello there.", "id": "greet"}),
        "   ",
        json.dumps({"prompt": "Name a colour."}),
    ])
    ps = load_jsonl(str(path))
    assert [p.kind for p in ps] == ["custom", "custom"]
    assert ps[0].id == "greet" and ps[1].id
    assert len({p.id for p in ps}) == 2
    assert ps[1].messages == ({"role": "user", "content": "Name a colour."},)


@pytest.mark.parametrize("bad", [
    "not json at all",
    "[1, 2, 3]",
    '"just a string"',
    '{"turns": []}',
    '{"turns": "a string, not a list"}',
    '{"turns": [1, 2]}',
    '{"prompt": 42}',
    '{"question": "wrong key"}',
    '{"messages": []}',
    '{"messages": "hello"}',
    '{"messages": [{"role": "user"}]}',
    '{"messages": [{"role": "robot", "content": "beep"}]}',
    '{"messages": [{"role": "user", "content": 3}]}',
    '{"messages": [{"role": "user", "content": "a", "extra": 1}]}',
    '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
])
def test_malformed_line_names_line_number_and_rule(tmp_path, bad):
    path = _write(tmp_path, [json.dumps({"prompt": "fine"}), "", bad])
    with pytest.raises(ValueError) as err:
        load_jsonl(path)
    msg = str(err.value)
    assert ":3:" in msg
    assert prompts.JSONL_RULE in msg
    assert "'turns' (a non-empty list of strings) or 'prompt' (a string)" in msg


# -------------------------------------------------------------------- encode


def test_encode_with_the_chat_template(tokenizer):
    ps = builtin_prompts()
    ids = encode(ps, tokenizer)
    assert len(ids) == len(ps)
    assert all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in ids)
    lengths = [len(x) for x in ids]
    assert min(lengths) < 40
    assert max(lengths) > 300
    # the generation prompt is appended: every prompt ends the same way
    tails = {tuple(x[-3:]) for x in ids}
    assert len(tails) == 1
    # the chat template marks each turn; a three-message chat has more turn markers
    single = tokenizer.decode(ids[[p.kind for p in ps].index("qa")])
    multi = tokenizer.decode(ids[[p.kind for p in ps].index("chat")])
    assert "Japan" in single
    assert multi.count("assistant") > single.count("assistant")


def test_joined_merges_consecutive_messages_of_one_role_only():
    ms = ({"role": "user", "content": "a"}, {"role": "user", "content": "b"},
          {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"})
    assert prompts.joined(ms) == [{"role": "user", "content": "a\n\nb"},
                                  {"role": "assistant", "content": "c"},
                                  {"role": "user", "content": "d"}]
    for p in builtin_prompts():  # every built-in conversation alternates: unchanged
        assert prompts.joined(p.messages) == list(p.messages)


def test_encode_a_multi_turn_specbench_question_asks_every_turn(tokenizer, tmp_path):
    path = _write(tmp_path, [json.dumps({"question_id": 1, "category": "writing",
                                         "turns": ["Name a fruit.", "Now name a colour."]})])
    [ids] = encode(load_jsonl(path), tokenizer)
    text = tokenizer.decode(ids)
    assert "Name a fruit." in text and "Now name a colour." in text
    assert text.count("<|im_start|>user") == 1  # one user message holding both turns


def test_encode_accepts_loaded_prompts(tokenizer, tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "Say hello."})])
    [ids] = encode(load_jsonl(path), tokenizer)
    assert "Say hello." in tokenizer.decode(ids)


def test_encode_without_a_chat_template_uses_plain_text(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    chat = next(p for p in builtin_prompts() if p.kind == "chat")
    qa = Prompt(id="q", kind="qa", messages=({"role": "user", "content": "Why is grass green?"},))
    ids_qa, ids_chat = encode([qa, chat], plain)
    assert ids_qa == plain("Why is grass green?")["input_ids"]  # the tokenizer's own specials
    text = plain.decode(ids_chat)
    for m in chat.messages:
        assert m["content"] in text
    assert text.rstrip().endswith("Assistant:")


def test_long_prompts_grow_row_to_row_from_the_built_in_texts():
    ps = prompts.long_prompts(8)
    words = [p.word_count() for p in ps]
    assert [p.kind for p in ps] == ["long"] * 8 and len({p.id for p in ps}) == 8
    assert words == sorted(words) and words[0] >= 440 and words[-1] - words[0] >= 150
    base = builtin_prompts()
    for i, p in enumerate(ps):  # prompt i starts with the (5 i)-th built-in text
        assert p.text.startswith("Note 1: " + " ".join(base[5 * i].text.split()[:6]))
    assert all(p.text.endswith("what is note 1 about?") for p in ps)


class _ListTokenizer:
    """A tokenizer whose chat template returns a plain list (older transformers)."""

    chat_template = "x"

    def apply_chat_template(self, messages, add_generation_prompt):
        assert add_generation_prompt and isinstance(messages, list)
        return [len(m["content"]) for m in messages] + [0]


def test_encode_handles_a_plain_list_from_the_template():
    p = Prompt(id="a", kind="custom", messages=({"role": "user", "content": "abc"},))
    assert encode([p], _ListTokenizer()) == [[3, 0]]
