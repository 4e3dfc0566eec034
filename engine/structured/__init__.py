"""Structured output: JSON Schema, regex and choice constraints enforced by per-token masks.

Entry point: `manager.StructuredOutputManager` (imported lazily by the engine so that the grammar library is
loaded only when a model is served). See backend.py for the library choice and its measurements,
steering.py for budget steering, normalize.py for the rewrites that keep outputs valid.
"""
