"""The detector process keeps its long-lived state out of later full garbage collections."""

from __future__ import annotations

import gc

from services.detector.__main__ import _freeze_survivors


class _State:
    def __init__(self) -> None:
        self.windows: dict[int, list[int]] = {i: [i] for i in range(100)}


def test_objects_that_survive_a_full_collection_are_frozen_and_still_usable() -> None:
    gc.callbacks.append(_freeze_survivors)
    gc.disable()  # only the collections below
    try:
        before = gc.get_freeze_count()
        kept = [_State() for _ in range(1000)]
        gc.collect(1)  # a young collection freezes nothing
        assert gc.get_freeze_count() == before
        gc.collect()
        assert gc.get_freeze_count() >= before + 1000
        kept[0].windows[0].append(1)
        assert kept[0].windows[0] == [0, 1]
    finally:
        gc.callbacks.remove(_freeze_survivors)
        gc.unfreeze()
        gc.enable()
