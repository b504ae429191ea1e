"""The OpenAI-compatible HTTP server: `server.py` (app, routes, errors), `serving.py` (chat and text
completions), `protocol.py` (wire models), `media.py` (content parts under the server's media
rules), `metrics.py` (Prometheus). Importing this package imports none of them (FastAPI loads
only when a server is built)."""
