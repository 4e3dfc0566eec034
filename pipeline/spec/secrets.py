"""Keeping credentials out of job specs, _job.json, logs and summaries: one rule, applied everywhere.

A spec is recorded verbatim in ``_job.json`` beside the results, so a secret written into it leaks to
everyone who can read the output. ``storage_options`` are therefore an allow-list of fsspec/s3fs
settings known to be non-secret (endpoints, region, addressing style, timeouts, retries, server-side
encryption *algorithm names*); anything else is refused by ``validate``, and so is any value that looks
like a credential (a URL with ``user:pass@``, an AWS access key id, a long token-like string) or any key
whose name looks like one (``SecretAccessKey``, ``sse_customer_key``, ``x-api-token``, in any case).
:func:`redact` applies the same rule when writing, so a document that never went through validate
(an old ``_job.json``, a test) cannot leak either.
"""

from __future__ import annotations

import re
from typing import Any

# name -> type of the value, or a nested allow-list. Types: bool, int (also accepts float for timeouts
# where noted by float), str.
_Allowed = dict[str, Any]
STORAGE_OPTIONS_ALLOWED: _Allowed = {
    "anon": bool, "endpoint_url": str, "requester_pays": bool, "use_ssl": bool, "default_block_size": int,
    "default_fill_cache": bool, "default_cache_type": str, "version_aware": bool, "cache_regions": bool,
    "max_concurrency": int, "fixed_upload_size": bool, "use_listings_cache": bool,
    "listings_expiry_time": float, "skip_instance_cache": bool, "auto_mkdir": bool,
    "client_kwargs": {"endpoint_url": str, "region_name": str, "verify": bool, "use_ssl": bool},
    "config_kwargs": {
        "connect_timeout": float, "read_timeout": float, "max_pool_connections": int,
        "signature_version": str, "region_name": str, "tcp_keepalive": bool,
        "retries": {"max_attempts": int, "total_max_attempts": int, "mode": str},
        "s3": {"addressing_style": str, "use_accelerate_endpoint": bool, "payload_signing_enabled": bool},
    },
    "s3_additional_kwargs": {"ServerSideEncryption": str, "SSECustomerAlgorithm": str, "StorageClass": str,
                             "ACL": str, "RequestPayer": str},
}
REDACTED = "<redacted>"
_SECRET_WORDS = {"secret", "password", "passwd", "pwd", "passphrase", "credential", "credentials", "apikey",
                 "auth", "authorization", "signature", "cookie", "private"}
# Words that name a credential only at the end of a name or before a qualifier (session_token,
# SSECustomerKey, SSECustomerKeyMD5, key_id), so that stop_token_ids or a keyring path stay allowed.
_TAIL_WORDS = {"token", "key", "session"}
_QUALIFIERS = {"id", "md5", "value", "data", "string", "b64", "base64"}
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s?#]+@")
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|ANPA)[A-Z0-9]{16}\b")
_TOKEN_LIKE = re.compile(r"[A-Za-z0-9+/=_\-]{32,}")
_SHORT = 40


def _words(name: str) -> list[str]:
    """`SSECustomerKey` -> [sse, customer, key]; `aws_secret_access_key` -> [aws, secret, access, key]."""
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", name)
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", spaced)
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def looks_secret(key: str) -> bool:
    """True for option names that may hold credentials (secret, SecretAccessKey, session_token, ...)."""
    words = _words(str(key))
    joined = "".join(words)
    tail = any(w in _TAIL_WORDS and (i == len(words) - 1 or words[i + 1] in _QUALIFIERS)
               for i, w in enumerate(words))
    return tail or any(w in _SECRET_WORDS for w in words) or any(
        part in joined for part in ("accesskey", "keyid", "apikey", "privatekey", "secret", "password"))


def credential_in(value: str) -> str | None:
    """Why the string `value` looks like a credential, or None."""
    if _USERINFO.search(value):
        return "a URL with user:password@ (userinfo)"
    if _AWS_KEY_ID.search(value):
        return "an AWS access key id"
    if _TOKEN_LIKE.fullmatch(value):
        return "a long token-like string"
    return None


def _shown(key: str) -> str:
    return key if len(key) <= _SHORT else key[: _SHORT - 1] + "…"


def storage_option_problems(options: Any, where: str) -> list[str]:
    """Problems of one storage_options mapping against the allow-list (empty when it is fine)."""
    fix = ("credentials come from the AWS environment/profile chain (AWS_ACCESS_KEY_ID, "
           "AWS_SECRET_ACCESS_KEY, AWS_PROFILE), never from the spec, which is recorded in _job.json")
    problems: list[str] = []
    stack: list[tuple[Any, _Allowed, str]] = [(options, STORAGE_OPTIONS_ALLOWED, where)]
    while stack and len(problems) < 10:
        value, allowed, path = stack.pop()
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping of options")
            continue
        for key in sorted(value, key=str):
            sub, child = f"{path}.{_shown(str(key))}", value[key]
            if looks_secret(str(key)) and str(key) not in allowed:
                problems.append(f"{sub}: credentials do not belong in a job spec (it is recorded in "
                                f"_job.json); {fix}")
            elif str(key) not in allowed:
                names = ", ".join(sorted(allowed))
                problems.append(f"{sub}: not an allowed storage option (allowed here: {names}); only "
                                "non-secret settings may appear in a spec")
            elif isinstance(allowed[key], dict):
                stack.append((child, allowed[key], sub))
            else:
                problems += _value_problems(child, allowed[key], sub, fix)
    return problems


def _value_problems(value: Any, kind: type, path: str, fix: str) -> list[str]:
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else isinstance(value, str))
    if not ok:
        return [f"{path}: expected {kind.__name__ if kind is not float else 'a number'}, "
                f"got {type(value).__name__}"]
    if isinstance(value, str):
        if len(value) > 2000:
            return [f"{path}: a value of {len(value):,} characters is too long (limit 2,000)"]
        why = credential_in(value)
        if why is not None:
            return [f"{path}: the value looks like a credential ({why}); {fix}"]
    return []


def url_problems(value: Any, where: str) -> list[str]:
    """A path or URL field must not carry credentials either (s3://key:secret@bucket/...)."""
    if isinstance(value, str) and _USERINFO.search(value):
        return [f"{where}: the URL holds user:password@ credentials; remove them (credentials come from "
                "the environment)"]
    return []


def redact_text(text: str) -> str:
    """`text` with URL userinfo and AWS key ids replaced (for log lines and error messages)."""
    text = _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text)
    return _AWS_KEY_ID.sub(REDACTED, text)


def _redact_options(value: Any, allowed: _Allowed) -> Any:
    if not isinstance(value, dict):
        return REDACTED
    out: dict[str, Any] = {}
    for key, child in value.items():
        rule = allowed.get(str(key))
        if rule is None:
            out[str(key)] = REDACTED
        elif isinstance(rule, dict):
            out[str(key)] = _redact_options(child, rule)
        elif isinstance(child, str) and credential_in(child):
            out[str(key)] = REDACTED
        elif isinstance(child, (dict, list)):
            out[str(key)] = REDACTED
        else:
            out[str(key)] = child
    return out


def redact(value: Any) -> Any:
    """A copy of a spec document safe to record: storage_options filtered through the allow-list
    (anything else becomes '<redacted>'), credentials removed from URLs everywhere. Iterative over lists
    and mappings so a deep document cannot exhaust the stack."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]
    while stack:
        src, dst, slot = stack.pop()
        if isinstance(src, dict):
            node: dict[Any, Any] = {}
            for k, v in src.items():
                if isinstance(k, str) and looks_secret(k):
                    node[k] = REDACTED
                elif k == "storage_options":
                    node[k] = _redact_options(v, STORAGE_OPTIONS_ALLOWED)
                else:
                    node[k] = None
                    stack.append((v, node, k))
            dst[slot] = node
        elif isinstance(src, list):
            items: list[Any] = [None] * len(src)
            stack.extend((v, items, i) for i, v in enumerate(src))
            dst[slot] = items
        else:
            dst[slot] = redact_text(src) if isinstance(src, str) else src
    return root[0]
