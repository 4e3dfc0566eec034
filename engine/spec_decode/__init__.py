"""MTP speculative decoding: DeepSeek's multi-token-prediction layer drafts, the target verifies exactly.

config.py (the `MTPConfig` option and `DEEPINFER_ENABLE_MTP_VARLEN`), mtp_model.py (the draft module;
DeepSeek-V4's in v4_mtp_model.py),
setup.py (loading it beside the target), policy.py (draft length, acceptance statistics, auto-off),
verify.py (the exact acceptance rule), proposer.py (the draft passes), step.py (one speculative step).
"""
