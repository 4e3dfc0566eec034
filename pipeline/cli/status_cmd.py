"""`deepinfer-job status OUTPUT|SPEC`: resolve the target, then print status.job_status (commit protocol)."""

from __future__ import annotations

import json

from deepinfer.pipeline.spec.load import load_spec


def resolve_target(target: str, overrides: list[str]) -> tuple[str, dict]:
    """(output URL, storage options): a spec file is loaded (relative paths, --set) to find its output."""
    if target.endswith((".yaml", ".yml")) and "://" not in target:
        spec = load_spec(target, overrides)
        return spec.output.path, dict(spec.output.storage_options)
    return target, {}


def show_status(target: str, overrides: list[str], as_json: bool = False) -> int:
    """Print the status of a job output; exit code 0 (state is in the output, not the code)."""
    from deepinfer.pipeline.cli.sweep_cmds import render_sweep_status, sweep_status
    from deepinfer.pipeline.output.status import job_status, render_status

    url, storage_options = resolve_target(target, overrides)
    swept = sweep_status(url, storage_options)
    if swept is not None:  # a sweep's output: every point's own status
        print(json.dumps(swept, indent=2, sort_keys=True) if as_json else render_sweep_status(swept))
        return 0
    status = job_status(url, storage_options)
    print(json.dumps(status, indent=2, sort_keys=True) if as_json else render_status(status))
    return 0
