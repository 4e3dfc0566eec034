"""deepinfer: offline batch LLM inference jobs with byte-identical, resumable output."""

__version__ = "0.1.0"
