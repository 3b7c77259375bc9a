"""Executors (`uni`, `mp`, `external_launcher`, `ray`) behind one interface: `execute_model`,
`sample_tokens` and `collective_rpc`, each optionally returning a Future; no scheduling policy.
"""
