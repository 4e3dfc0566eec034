"""Structured output: JSON Schema, regex and choice constraints enforced by per-token masks.

Entry points: `manager.StructuredOutputManager`, the one owner of grammar state, and
`lazy.LazyStructuredOutputs`, the engine's handle, which imports and builds the manager only when a
constrained request needs it (so the grammar library is loaded and the vocabulary compiled only then).
See backend.py for the library choice and its measurements, steering.py for budget steering,
normalize.py for the rewrites that keep outputs valid.
"""
