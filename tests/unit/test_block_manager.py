import pytest

from disagg.engine.block_manager import BlockManager

pytestmark = pytest.mark.unit


def test_blocks_round_up():
    bm = BlockManager(num_blocks=10, block_size=16)
    assert bm.blocks_needed(1) == 1
    assert bm.blocks_needed(16) == 1
    assert bm.blocks_needed(17) == 2


def test_allocate_and_free_return_blocks():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate("a", 33)  # 3 blocks
    assert bm.num_free_blocks == 1 and bm.num_used_blocks == 3
    assert bm.can_allocate(16) and not bm.can_allocate(17)
    bm.free("a")
    assert bm.num_free_blocks == 4
    bm.free("a")  # freeing twice is harmless
    assert bm.num_free_blocks == 4


def test_can_ever_allocate_is_about_the_whole_budget():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate("a", 64)
    assert bm.can_ever_allocate(64) and not bm.can_allocate(1)
    assert not bm.can_ever_allocate(65)


def test_double_allocate_is_an_internal_error():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate("a", 1)
    with pytest.raises(AssertionError):
        bm.allocate("a", 1)
