"""Speculative decoding: the config (vLLM's ``speculative_config``) and the proposers behind one interface."""
