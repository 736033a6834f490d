"""The engines: requests, the KV block pool, the scheduler, the sync engine and the ``LLM`` API."""
