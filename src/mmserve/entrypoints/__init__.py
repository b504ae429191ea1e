"""User-facing entry points: the offline API (`llm.py`), the command line (`cli.py`) and the OpenAI-compatible
server (`openai/`). They reach the engine, never the runner."""
