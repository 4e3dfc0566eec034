"""The prompts `LLM.generate` takes: text, token ids, or vLLM's {"prompt": ...} and {"prompt_token_ids": ...}
dicts."""

from __future__ import annotations

from deepinfer.engine.text.tokenizer import Tokenizer


def prompt_items(prompts: list, tokenizer: Tokenizer) -> tuple[list[str | None], list[list[int]]]:
    """(prompt texts, token ids) of str, token-id list, {"prompt": str} or {"prompt_token_ids": [...]}
    items (vLLM's TextPrompt / TokensPrompt); strings are tokenized in one batch."""
    texts: list[str | None] = []
    raw: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            extra = sorted(set(p) - {"prompt", "prompt_token_ids"})
            if extra or len(p) != 1:
                raise ValueError(f"prompt {i}: a dict prompt holds exactly one of 'prompt' (str) or "
                                 f"'prompt_token_ids' (list of ints); got keys {sorted(p)}")
            p = p.get("prompt", p.get("prompt_token_ids"))
            if "prompt" in prompts[i] and not isinstance(p, str):
                raise ValueError(f"prompt {i}: 'prompt' must be a string, not {type(p).__name__}")
        if isinstance(p, str):
            texts.append(p)
            raw.append(p)
        elif isinstance(p, (list, tuple)) and all(issubclass(t, int) for t in set(map(type, p))):
            texts.append(None)
            raw.append(list(p))
        else:
            kind = type(p).__name__
            raise ValueError(f"prompt {i} must be a string or a list of token ids, not {kind}")
    str_idx = [i for i, p in enumerate(raw) if isinstance(p, str)]
    encoded: dict[int, list[int]] = {}
    if str_idx:
        encoded = dict(zip(str_idx, tokenizer.encode_batch([raw[i] for i in str_idx])))
    return texts, [encoded[i] if isinstance(p, str) else p for i, p in enumerate(raw)]
