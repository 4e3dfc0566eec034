"""What every run summary's `startup` figures must satisfy (startup_clock.StartupClock), for the tests
that run jobs: present, and in the order the phases happen."""

from __future__ import annotations

# Marks in the order they happen in one run (each one seconds since the run's clock started).
ORDERED = ("engine_actor_started_s", "engine_imported_s", "model_loaded_s", "engine_ready_s",
           "first_token_s", "first_commit_s", "last_result_s", "wall_s")


def check_startup(summary: dict, ray: bool) -> dict:
    """Assert `summary`'s startup figures are there and ordered; returns them."""
    s = summary["startup"]
    marks = [s[k] for k in ORDERED]
    assert all(m is not None for m in marks), s
    assert all(a <= b + 1e-3 for a, b in zip(marks, marks[1:])), s  # rounded to ms, one clock per node
    assert s["driver_process_started_s"] is None or s["driver_process_started_s"] <= 0, s
    assert s["model_checked_s"] <= s["output_opened_s"] <= s["executor_requested_s"] <= s["first_result_s"]
    assert s["engine_ready_s"] <= s["first_part_received_s"] <= s["first_token_s"] + 1e-3, s
    assert s["first_commit_s"] == summary["time_to_first_commit_s"]
    assert s["first_token_s"] == summary["time_to_first_token_s"]
    assert s["wall_s"] == summary["wall_seconds"]
    assert (s["executor_started_s"] is not None) == ray, s
    for key in ("engine_wait_s", "engine_generate_s", "engine_commit_s"):
        assert s[key] >= 0, s
    assert s["engine_generate_s"] > 0, s
    return s
