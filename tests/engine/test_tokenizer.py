"""Tokenizer and chat templates: same ids, text and rendered prompts as HF transformers (test-only there)."""

from __future__ import annotations

import json
import pickle
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from deepinfer.engine.models.demo import write_tokenizer_files
from deepinfer.engine.text.chat_template import ChatTemplate, validate_messages
from deepinfer.engine.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Exercises the HF conventions: trim/lstrip blocks, tojson (no HTML escaping), loop controls, raise_exception,
# {% generation %}, namespace, and an extra variable passed through (tools).
FEATURE_TEMPLATE = """
{%- set ns = namespace(n=0) -%}
{% if tools is defined and tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'system' and not loop.first %}
        {{ raise_exception('system message must come first') }}
    {% endif %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ m['role'] }}: {% if m['role'] == 'assistant' %}
{% generation %}{{ m['content'] }}{% endgeneration %}
    {% else %}{{ m['content'] }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}[{{ ns.n + 1 }}] assistant:{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Is it going to rain tomorrow?"}],
    [
        {"role": "system", "content": "You label reviews as positive, negative or neutral."},
        {"role": "user", "content": "  The kettle boils fast <but> the lid & hinge feel weak.  "},
        {"role": "assistant", "content": '{"label": "neutral"}'},
        {"role": "user", "content": "Café au lait 日本 😊"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"},
     {"role": "skip", "content": "x"}],
]
TEXTS = ["", "Hello world", " leading space", "Café au lait 日本 😊 🍜", "line\n\n  tabs\tand  spaces ",
         "<|begin_of_text|>already has bos", "<|im_start|>user\nhi<|im_end|>\n", "{\"label\": \"positive\"}"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return d


def _variant(src: Path, dst: Path, *, config: dict | None = None, drop: tuple[str, ...] = (),
             post_processor: bool = True) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config or {})
    for k in drop:
        cfg.pop(k, None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    if not post_processor:
        tok = json.loads((dst / "tokenizer.json").read_text())
        tok["post_processor"] = None
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(demo_dir: Path, text: str, add_special_tokens: bool) -> None:
    ours = Tokenizer.from_dir(demo_dir)
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    expected = hf(text, add_special_tokens=add_special_tokens).input_ids
    if add_special_tokens and expected[:2] == [0, 0]:
        expected = expected[1:]  # deepinfer never doubles bos (HF does when the text already has it)
    assert ours.encode(text, add_special_tokens=add_special_tokens) == expected
    assert ours.encode_batch([text, text], add_special_tokens=add_special_tokens) == [expected, expected]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(demo_dir: Path, skip_special_tokens: bool) -> None:
    ours = Tokenizer.from_dir(demo_dir)
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens) == expected
    assert ours.decode(ours.encode(TEXTS[3], add_special_tokens=False)) == TEXTS[3]


def test_special_token_ids_and_vocab(demo_dir: Path) -> None:
    tok = Tokenizer.from_dir(demo_dir)
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    assert tok.vocab_size == len(hf) == 512
    assert (tok.bos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.pad_token_id) == (0, 4)
    assert tok.eos_token_ids == (1, 3)  # config eos first, then generation_config's extra end-of-turn id
    assert tok.eos_token_id == hf.eos_token_id == 1
    # Every token tokenizer.json marks special (HF lists only the config's named ones).
    assert tok.all_special_ids == [0, 1, 2, 3, 4]
    assert set(hf.all_special_ids) <= set(tok.all_special_ids)
    assert tok.convert_ids_to_tokens([0, 44]) == hf.convert_ids_to_tokens([0, 44])
    assert tok.model_max_length == 2048


# (post-processor adds bos, tokenizer_config add_bos_token) -> does encode start with exactly one bos?
BOS_CASES = [(True, True, True), (True, None, True), (True, False, False),
             (False, True, True), (False, None, False), (False, False, False)]


@pytest.mark.parametrize(("post_processor", "add_bos", "expect_bos"), BOS_CASES)
def test_bos_is_added_once_as_configured(demo_dir: Path, tmp_path: Path, post_processor: bool,
                                         add_bos: bool | None, expect_bos: bool) -> None:
    cfg = {} if add_bos is None else {"add_bos_token": add_bos}
    d = _variant(demo_dir, tmp_path / "v", config=cfg, drop=("add_bos_token",) if add_bos is None else (),
                 post_processor=post_processor)
    tok = Tokenizer.from_dir(d)
    plain = tok.encode("Hi there", add_special_tokens=False)
    assert tok.encode("Hi there") == ([0] if expect_bos else []) + plain
    with_bos = tok.encode("<|begin_of_text|>Hi there")
    assert with_bos == [0] + plain  # never twice, and the text's own bos is kept
    assert tok.encode_batch(["Hi there", "<|begin_of_text|>Hi there"]) == [tok.encode("Hi there"), with_bos]


def test_special_tokens_given_as_added_token_dicts(demo_dir: Path, tmp_path: Path) -> None:
    d = _variant(demo_dir, tmp_path / "v", config={
        "bos_token": {"content": "<|begin_of_text|>", "special": True, "__type": "AddedToken"},
        "eos_token": {"content": "<|im_end|>", "lstrip": False}})
    tok = Tokenizer.from_dir(d)
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, (3, 1))


def test_missing_tokenizer_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"tokenizer.json not found in {tmp_path}"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_encode_rejects_non_strings(demo_dir: Path) -> None:
    tok = Tokenizer.from_dir(demo_dir)
    with pytest.raises(ValueError, match="str"):
        tok.encode(["a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"texts\[1\]"):
        tok.encode_batch(["a", 3])  # type: ignore[list-item]


def test_tokenizer_survives_pickling_and_hash_is_stable(demo_dir: Path) -> None:
    tok = Tokenizer.from_dir(demo_dir)
    tok.apply_chat_template(CONVERSATIONS[0])  # compile the template before pickling
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(TEXTS[3]) == tok.encode(TEXTS[3])
    assert clone.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])
    assert clone.content_hash() == tok.content_hash() == Tokenizer.from_dir(demo_dir).content_hash()


@pytest.mark.parametrize("template", ["chatml", LLAMA3_TEMPLATE, FEATURE_TEMPLATE],
                         ids=["chatml", "llama3", "features"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(demo_dir: Path, tmp_path: Path, template: str,
                                                 conversation: int, add_generation_prompt: bool) -> None:
    d = demo_dir
    if template != "chatml":
        d = _variant(demo_dir, tmp_path / "v", config={"chat_template": template})
    msgs = CONVERSATIONS[conversation]
    if template == "chatml" and conversation == 2:
        msgs = msgs[:2]  # the demo ChatML template only accepts system/user/assistant
    tools = [{"name": "lookup", "description": "<find> & fetch"}]
    kwargs = {"tools": tools} if template == FEATURE_TEMPLATE else {}
    hf = transformers.AutoTokenizer.from_pretrained(d)
    gen = add_generation_prompt
    expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kwargs)
    ours = Tokenizer.from_dir(d).apply_chat_template(msgs, add_generation_prompt=gen, **kwargs)
    assert ours == expected


def test_chat_prompt_tokenizes_like_transformers(demo_dir: Path) -> None:
    tok = Tokenizer.from_dir(demo_dir)
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    expected = hf.apply_chat_template(CONVERSATIONS[1], tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    text = tok.apply_chat_template(CONVERSATIONS[1])
    assert tok.encode(text, add_special_tokens=False) == list(expected)
    assert tok.encode(text) == list(expected)  # bos in the text is not doubled


def test_chat_template_file_beside_config_is_used(demo_dir: Path, tmp_path: Path) -> None:
    d = _variant(demo_dir, tmp_path / "v", drop=("chat_template",))
    jinja = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (d / "chat_template.jinja").write_text(jinja)
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"


def test_named_template_list_uses_default(demo_dir: Path, tmp_path: Path) -> None:
    d = _variant(demo_dir, tmp_path / "v", config={"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]})
    assert Tokenizer.from_dir(d).apply_chat_template(CONVERSATIONS[0]) == "DEFAULT"


def test_missing_chat_template_suggests_raw_prompts(demo_dir: Path, tmp_path: Path) -> None:
    d = _variant(demo_dir, tmp_path / "v", drop=("chat_template",))
    with pytest.raises(ValueError, match="has no chat_template.*raw prompts"):
        Tokenizer.from_dir(d).apply_chat_template(CONVERSATIONS[0])


BAD_MESSAGES = [
    ("not a list", "must be a list"),
    ([{"role": "user", "content": "ok"}, "hi"], r"messages\[1\]: must be a dict"),
    ([{"content": "no role"}], r"messages\[0\]: 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], r"messages\[1\]: 'role'"),
    ([{"role": "user"}], r"messages\[0\] \(role 'user'\): missing 'content'"),
    ([{"role": "user", "content": 5}], r"messages\[0\].*'content' must be"),
]


@pytest.mark.parametrize(("messages", "match"), BAD_MESSAGES)
def test_bad_messages_name_the_index(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


def test_template_errors_become_value_errors() -> None:
    tpl = ChatTemplate(FEATURE_TEMPLATE)
    msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(ValueError, match="system message must come first"):
        tpl.render(msgs)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}").render(msgs)
    with pytest.raises(ValueError, match="rejected"):  # the sandbox forbids mutating data
        ChatTemplate("{{ messages.append(1) }}").render(msgs)


def test_strftime_now_can_be_pinned() -> None:
    tpl = ChatTemplate("{{ strftime_now('%d %b %Y') }}|{{ bos_token }}", {"bos_token": "<s>"})
    assert tpl.render([], now=datetime(2024, 7, 26)) == "26 Jul 2024|<s>"
