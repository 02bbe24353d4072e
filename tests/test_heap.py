"""jaxrl/heap.py: the collector's settings in a jaxrl process."""

import gc
import weakref

from jaxrl.heap import YOUNGEST_EVERY, collect_less, frozen_heap


class Node:
    pass


def cycle() -> tuple[Node, weakref.ref]:
    node = Node()
    node.me = node
    return node, weakref.ref(node)


def test_collect_less_raises_the_youngest_generation_s_threshold():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)         # CPython's default
        collect_less()
        assert gc.get_threshold()[0] == YOUNGEST_EVERY > 700
    finally:
        gc.set_threshold(*before)


def test_a_frozen_cycle_outlives_collections_in_the_block_and_goes_after_it():
    kept, kept_ref = cycle()
    dropped_ref = cycle()[1]            # garbage already: the block's first collection takes it
    with frozen_heap():
        assert dropped_ref() is None
        assert gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert kept_ref() is not None   # frozen: no pass of the loop walks it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert kept_ref() is None


def test_a_cycle_made_in_the_block_is_collected_in_it():
    with frozen_heap():
        node, ref = cycle()
        del node
        gc.collect()
        assert ref() is None
