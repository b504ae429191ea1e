"""The OpenAI-compatible HTTP server: `server.py` (the app's assembly, `serve`), one module per endpoint
family (`chat.py`, `completions.py`, `tokens.py`, `models.py`, `health.py`) over `serving.py` (prompt
processing and submission) and `streaming.py` (usage, SSE streams), `protocol.py` (the wire models they
share), `http_errors.py` (OpenAI's error shape), `media.py` (content parts under the server's media
rules), `metrics.py` (Prometheus). Importing this package imports none of them (FastAPI loads
only when a server is built)."""
