"""Spec checks for where prompts come from and the formats that belong together (validate-time errors).

A prompt comes from exactly one of: `prompt.template` (jinja over the row), `prompt.messages_column` (a
column holding the conversation) or, with `input.format: openai_batch`, each line's `body.messages`.
`output.format: openai_batch` needs Batch input (its lines are keyed by custom_id) and has no place for
eval score columns. Each problem names the field path and what to change.
"""

from __future__ import annotations

from typing import Any


def request_format_problems(doc: dict[str, Any]) -> list[str]:
    """Problems with prompt source / input and output format combinations in a filled spec document."""
    problems: list[str] = []
    prompt, inp, out = doc["prompt"], doc["input"], doc["output"]
    template, messages = prompt.get("template"), prompt.get("messages_column")
    batch_in = inp["format"] == "openai_batch"
    if batch_in:
        sources = (("template", template), ("messages_column", messages), ("system", prompt["system"]))
        for key, value in sources:
            if value is not None:
                problems.append(f"prompt.{key}: input.format openai_batch takes each line's body.messages "
                                f"as the prompt; remove prompt.{key}")
        if inp["id_column"] not in (None, "custom_id"):
            problems.append("input.id_column: with input.format openai_batch the row id is custom_id; "
                            "set it to null or 'custom_id'")
        if prompt["mode"] != "chat":
            problems.append("prompt.mode: input.format openai_batch renders body.messages with the chat "
                            "template; set prompt.mode: chat")
    elif template is None and messages is None:
        problems.append("prompt.template: required field is missing (a jinja template over the row; or "
                        "give prompt.messages_column, a column holding a list of {role, content} messages)")
    elif template is not None and messages is not None:
        problems.append("prompt: give exactly one of prompt.template (a jinja template over the row) or "
                        "prompt.messages_column (a column holding a list of {role, content} messages)")
    if messages is not None:
        if prompt["mode"] != "chat":
            problems.append("prompt.messages_column: messages are rendered with the model's chat template; "
                            "set prompt.mode: chat")
        if prompt["system"] is not None:
            problems.append("prompt.system: with prompt.messages_column the system message is part of the "
                            "messages; remove prompt.system")
    if out["format"] == "openai_batch":
        if not batch_in:
            problems.append("output.format: openai_batch output lines are keyed by custom_id; it needs "
                            "input.format: openai_batch")
        if doc.get("eval"):
            problems.append("output.format: openai_batch has no place for eval score columns; use parquet "
                            "or jsonl output with an eval section")
        if out["keep_columns"]:
            problems.append("output.keep_columns: openai_batch output lines carry only id, custom_id, "
                            "response and error; remove keep_columns")
    if doc.get("output_schema") is not None and batch_in:
        problems.append("output_schema: with input.format openai_batch each line's body.response_format "
                        "sets its schema; remove output_schema")
    return problems
