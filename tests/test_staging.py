"""Host staging: the packed layout of a step's int sections, and the list-to-tensor packing it and the
sampler's uploads use."""
from __future__ import annotations

import array
import random
import struct

import pytest
import torch

from vtcore.worker.sampler import to_device
from vtcore.worker.staging import Staging, host_tensor
from vtcore.worker.step import int64_range, int64s, kv_slot_int64s, kv_slots


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool, torch.float64])
def test_host_tensor_equals_torch_tensor_of_the_list(dtype):
    ints = [0, 1, -1, 7, 2**31 - 1, -(2**31)]
    data = [0.1, -2.5, 1e30, 3.0, -0.0, 1] if dtype.is_floating_point else ints
    if dtype == torch.int64:
        data = ints + [2**62, -(2**63)]
    if dtype == torch.bool:
        data = [True, False, True]
    got, want = host_tensor(data, dtype), torch.tensor(data, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(host_tensor([], dtype), torch.tensor([], dtype=dtype))


def test_an_int_section_with_a_float_in_it_is_refused_not_truncated():
    with pytest.raises(struct.error):
        host_tensor([1, 2.5], torch.int64)


def test_kv_slots_are_each_positions_block_slot():
    rng = random.Random(0)
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 16])
        blocks = rng.sample(range(1000), 12)
        start = rng.randrange(12 * bs)
        end = rng.randrange(start, 12 * bs + 1)
        assert kv_slots(blocks, bs, start, end) == [blocks[p // bs] * bs + p % bs for p in range(start, end)]
    with pytest.raises(IndexError, match="need 3 blocks, the request has 2"):
        kv_slots([5, 6], 4, 0, 12)
    with pytest.raises(IndexError):
        kv_slots([5, 6], 4, 8, 9)  # (a short range: the per-position expression)


def test_to_device_uploads_lists_and_tensors_alike():
    cpu = torch.device("cpu")
    assert torch.equal(to_device([3, 1, 2], torch.int64, cpu), torch.tensor([3, 1, 2]))
    assert torch.equal(to_device(torch.tensor([0.5, 2.0]), torch.float32, cpu), torch.tensor([0.5, 2.0]))


def test_stage_packs_sections_at_their_alignment_and_reuses_a_retired_buffer():
    staging = Staging(2, torch.device("cpu"))
    sections = [[5, 6, 7], [], [8], list(range(100, 140))]
    staged = staging.stage(0, sections)
    assert staged.bounds == [(0, 3), (4, 4), (4, 5), (6, 46)]
    assert all(a % 2 == 0 for a, _ in staged.bounds)
    for section, (a, b) in zip(sections, staged.bounds):
        assert staged.host[a:b].tolist() == section
    assert staged.host[3].item() == 0 and staged.host[5].item() == 0  # padding
    dense = staging.stage(1, sections, align=1)
    assert dense.host.tolist() == [x for s in sections for x in s]
    with pytest.raises(RuntimeError, match="still owned by step 0"):
        staging.stage(2, [[1]])
    staging.retire(staged.index)
    again = staging.stage(2, [[9, 9]])
    assert again.host.tolist() == [9, 9] and dense.host.tolist() == [x for s in sections for x in s]
    staging.retire(again.index)
    reused = staging.stage(0, [[1], [2, 3], [4]])  # over the first step's values: its padding is zeros again
    assert reused.host.tolist() == [1, 0, 2, 3, 4, 0]
    staging.retire(reused.index)
    grown = staging.stage(0, [list(range(1000)), [-1]])  # past the buffer: a larger one
    assert grown.host[:1000].tolist() == list(range(1000)) and grown.host[1000:].tolist() == [-1, 0]


def test_an_int64_buffer_section_is_staged_as_its_list_is():
    """A section given as native int64s (a memoryview of format q: a chunk's positions, KV slots) lands in the
    buffer as the same ints as its list would, at the same bounds, alignment padding included."""
    staging = Staging(2, torch.device("cpu"))
    lists = [[5, 6, 7], list(range(-3, 40)), [8]]
    mixed = [lists[0], int64s(array.array("q", lists[1])), lists[2]]
    a, b = staging.stage(0, lists), staging.stage(1, mixed)
    assert b.bounds == a.bounds and b.host.tolist() == a.host.tolist()


def test_kv_slot_int64s_are_kv_slots_padded_and_the_counting_table_grows():
    rng = random.Random(1)
    for _ in range(200):
        bs = rng.choice([1, 4, 16])
        blocks = rng.sample(range(5000), 12)
        start = rng.randrange(12 * bs)
        end = rng.randrange(start + 1, 12 * bs + 1)
        pad = rng.randrange(3)
        assert kv_slot_int64s(blocks, bs, start, end, end - start + pad).tolist() == (
            kv_slots(blocks, bs, start, end) + [-1] * pad)
    assert int64_range(70_000, 70_003).tolist() == [70_000, 70_001, 70_002]
    with pytest.raises(IndexError, match="need 3 blocks, the request has 2"):
        kv_slot_int64s([5, 6], 4, 0, 12, 12)


def test_each_staging_buffer_has_its_own_token_row_which_grows_and_is_reused():
    """A step's sampled tokens land in its staging buffer's token row: steps in flight at once (other
    buffers) never share one, and a buffer's next step reuses it."""
    staging = Staging(2, torch.device("cpu"))
    a, b = staging.host_tokens(0, 4), staging.host_tokens(1, 4)
    a.fill_(1)
    b.fill_(2)
    assert a.tolist() == [1] * 4 and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    again = staging.host_tokens(0, 3)
    assert again.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and again.shape == (3,)
    grown = staging.host_tokens(0, 9)
    assert grown.shape == (9,) and grown.dtype == torch.int64

