"""The OpenAI-compatible HTTP server (`llmsched serve`): FastAPI on uvicorn over an engine thread.

Importing this package loads nothing heavy; ``llmsched.server.launch`` and
``llmsched.server.app`` need the ``serve`` extra (fastapi, uvicorn,
prometheus_client).
"""
