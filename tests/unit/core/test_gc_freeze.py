import gc

import pytest

from kenosis_rewrite.core import gc_freeze


@pytest.fixture
def collector_state():
    """Restores the collector as the test found it, whatever the test did to it."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _cycle_collected_during_block() -> bool:
    """Whether a cycle made inside the block is collected inside it."""
    collected = []
    with gc_freeze.objects_before_frozen():
        gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
        try:
            _Cycle()
            gc.collect()
        finally:
            gc.callbacks.pop()
    return sum(collected) > 0


def test_objects_alive_before_the_block_are_frozen_inside_it_and_released_after(collector_state):
    gc.collect()
    assert gc.get_freeze_count() == 0
    with gc_freeze.objects_before_frozen():
        assert gc.get_freeze_count() > 1000  # the modules, this test's frames...
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_garbage_made_inside_the_block_is_still_collected(collector_state):
    assert _cycle_collected_during_block()


def test_the_callers_own_freeze_is_left_alone(collector_state):
    gc.freeze()
    frozen = gc.get_freeze_count()
    with gc_freeze.objects_before_frozen():
        _Cycle()
    assert gc.get_freeze_count() == frozen  # not unfrozen by the block


def test_a_disabled_collector_stays_disabled_and_nothing_is_frozen(collector_state):
    gc.disable()
    with gc_freeze.objects_before_frozen():
        assert gc.get_freeze_count() == 0
    assert not gc.isenabled()


def test_the_freeze_is_released_when_the_call_raises(collector_state):
    @gc_freeze.caller_objects_frozen
    def failing():
        assert gc.get_freeze_count() > 0
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        failing()
    assert gc.get_freeze_count() == 0
