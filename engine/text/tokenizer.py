"""Tokenizer: a thin wrapper over a Hugging Face ``tokenizers`` tokenizer.json plus tokenizer_config.json.

Only the ``tokenizers`` library is used at run time (no ``transformers``). Behaviour matches HF fast
tokenizers for what the engine needs: special-token handling, bos insertion (never twice), decoding and chat
templates. ``decode`` returns the library's decoding as is (HF's optional ``clean_up_tokenization_spaces``
post-edit is not applied: it is not prefix-stable, so incremental detokenization could not match it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from deepinfer.engine.text.chat_template import ChatTemplate, select_template
from tokenizers import Tokenizer as _HFTokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_content(value: object) -> str | None:
    """tokenizer_config stores a special token as a string or as a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Encode/decode text for one model directory. Build with ``Tokenizer.from_dir``.

    ``eos_token_ids`` is the config's ``eos_token`` followed by any further ids listed as ``eos_token_id`` in
    generation_config.json (how instruct models such as Llama-3 declare their end-of-turn tokens).
    """

    def __init__(self, tokenizer: _HFTokenizer, config: Mapping[str, Any],
                 generation_config: Mapping[str, Any] | None = None, chat_template: str | None = None,
                 name: str = "<memory>") -> None:
        self._tok = tokenizer
        self._config = dict(config)
        self.name = name
        self._specials = {k: _token_content(self._config.get(k)) for k in _SPECIAL_KEYS}
        self.bos_token: str | None = self._specials["bos_token"]
        self.eos_token: str | None = self._specials["eos_token"]
        self.pad_token: str | None = self._specials["pad_token"]
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        self.pad_token_id: int | None = self._id_of(self.pad_token)
        eos = [i for i in [self._id_of(self.eos_token)] if i is not None]
        for i in _as_id_list((generation_config or {}).get("eos_token_id")):
            if i not in eos:
                eos.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.eos_token_id: int | None = eos[0] if eos else None
        mml = self._config.get("model_max_length")
        self.model_max_length: int | None = mml if isinstance(mml, int) and mml < 10**12 else None
        # Does tokenizer.json's post-processor prepend bos by itself? (Llama-3 style.)
        probe = self._tok.encode("", add_special_tokens=True).ids
        self._pp_adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        add_bos = self._config.get("add_bos_token")
        self._add_bos = bool(add_bos) if isinstance(add_bos, bool) else self._pp_adds_bos
        self._add_bos = self._add_bos and self.bos_token_id is not None
        source = select_template(chat_template if chat_template is not None else config.get("chat_template"))
        self.chat_template: str | None = source
        self._chat = ChatTemplate(source, self._specials) if source else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``model_dir``/tokenizer.json (+ tokenizer_config.json, generation_config.json and
        chat_template.jinja when present). Raises ValueError when tokenizer.json is missing or unreadable."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"tokenizer.json not found in {d}: deepinfer needs a fast (tokenizers) tokenizer file there"
            )
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a plain Exception on malformed files
            raise ValueError(f"{path}: cannot be loaded by the tokenizers library ({e})") from e
        jinja_file = d / "chat_template.jinja"  # newer HF layouts keep the template beside the config
        template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
        return cls(tok, _read_json(d / "tokenizer_config.json"), _read_json(d / "generation_config.json"),
                   chat_template=template, name=str(d))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _fix_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos_token_id
        if self._pp_adds_bos and not self._add_bos:
            return ids[1:]  # config says no bos: undo the post-processor's
        if self._add_bos:
            if not ids or ids[0] != bos:
                return [bos, *ids]  # type: ignore[list-item]
            if self._pp_adds_bos and ids[1:2] == [bos]:
                return ids[1:]  # the text itself began with bos (e.g. a rendered chat template)
        return ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` a leading bos is added when the tokenizer adds
        one (config ``add_bos_token`` or its post-processor), and never a second one if ``text`` has it."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._fix_bos(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` for many texts at once (the library's parallel batch encode)."""
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"encode_batch: texts[{i}] is {type(t).__name__}, expected str")
        encs = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        if not add_special_tokens:
            return [e.ids for e in encs]
        return [self._fix_bos(e.ids) for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of tokens marked special in tokenizer.json plus the config's bos/eos/pad/unk, sorted."""
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        ids.update(i for i in (self._id_of(v) for v in self._specials.values()) if i is not None)
        return sorted(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            now: datetime | None = None, **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template (see chat_template.ChatTemplate.render).

        The result usually begins with bos already: encode it with ``add_special_tokens=False`` (HF's
        convention); ``encode`` with special tokens would not double bos either.
        """
        if self._chat is None:
            raise ValueError(
                f"the model at {self.name} has no chat_template (in tokenizer_config.json or "
                "chat_template.jinja): use raw prompts instead of chat messages"
            )
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt, now=now, **kwargs)

    def content_hash(self) -> str:
        """sha256 over the tokenizer definition and config (for job fingerprints)."""
        h = hashlib.sha256(self._tok.to_str().encode("utf-8"))
        h.update(json.dumps(self._config, sort_keys=True, default=str).encode("utf-8"))
        h.update((self.chat_template or "").encode("utf-8"))
        return h.hexdigest()
