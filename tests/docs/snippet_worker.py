"""Runs a documentation page's Python blocks in one namespace, one block per request, for tests/docs/snippets.py.

Protocol: one JSON object a line on stdin, `{"code": ..., "where": "README.md:42"}`; one JSON line back on
the stdout it was started with, `{"ok": true}` or `{"ok": false, "error": traceback}`. What a block
prints goes to stderr (fd 1 is pointed there), so the replies cannot be mixed with it. The namespace's
`__name__` is "__main__", so a block's `if __name__ == "__main__":` guard runs, as in a script; this
module is guarded too, so processes started with spawn (encoder workers) can import it. The working
directory (the scratch copy of the checkout) leads `sys.path`, as in a Python session started at the
checkout's root: a block may import the repository's `testkit`.

What it does not know: markdown, directives, servers (the harness substitutes ports before sending).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the blocks' prints: to stderr, the log the harness shows when a block fails
    namespace: dict = {"__name__": "__main__"}
    sys.path.insert(0, os.getcwd())
    for line in sys.stdin:
        request = json.loads(line)
        try:
            exec(compile(request["code"], request["where"], "exec"), namespace)  # noqa: S102 (what it is for)
            reply = {"ok": True}
        except BaseException:  # noqa: BLE001 (SystemExit included: a block that exits failed)
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
