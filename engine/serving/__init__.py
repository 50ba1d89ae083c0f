"""Serving: the OpenAI-compatible HTTP server. Request parsing and rendering (`completion`),
the pool of cached sequences keyed by token ids, the model-owner worker thread, and the
Starlette app. Sits on `runtime`; nothing below imports it."""
