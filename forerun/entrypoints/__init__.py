"""The `forerun` command line (serve, generate, chat, bench) and the OpenAI-compatible HTTP server,
built on the engine's public API only.
"""
