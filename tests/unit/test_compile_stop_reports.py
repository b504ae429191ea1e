"""A background compile's stop that lands where Python cannot raise it (a weakref callback, a __del__) is
not printed as "Exception ignored ..." on stderr (runner/graphs/decode_graphs.py); every other unraisable
exception still reaches the hook that was there before."""

import sys

from mmserve.runner.graphs.decode_graphs import CompileStopped, _drop_unraisable_stops


class _RaisesOnDelete:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __del__(self) -> None:
        raise self.error


def test_only_a_lost_compile_stop_is_dropped(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_value))
    _drop_unraisable_stops()
    _drop_unraisable_stops()  # installed once: the earlier hook is not wrapped twice
    _RaisesOnDelete(CompileStopped())
    _RaisesOnDelete(ValueError("a real problem"))
    assert [type(e) for e in reported] == [ValueError]
    assert sys.unraisablehook.drops_compile_stops
