"""User-facing entry points: the command line and (later) the offline API and the server."""
