"""Packed weights and the KV cache on transparent huge pages (fdcore.models.tensors)."""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest

from fdcore.models.tensors import HUGE_PAGE, on_huge_pages, packing_weights, zeros_on_huge_pages

pytestmark = pytest.mark.kernels


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def _is_mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_arrays_start_zeroed_on_a_2_mib_boundary_and_small_ones_are_plain():
    big = zeros_on_huge_pages((3, HUGE_PAGE // 4), np.float32)
    assert big.shape == (3, HUGE_PAGE // 4) and big.dtype == np.float32 and big.flags.c_contiguous
    assert big.ctypes.data % HUGE_PAGE == 0 and not big.any()
    big[...] = 1.5
    assert big.sum() == 1.5 * big.size
    small = zeros_on_huge_pages((10, 7), np.int16)
    assert small.shape == (10, 7) and not small.any() and small.base is None  # np.zeros's own


def test_a_models_arrays_are_carved_from_shared_regions_without_overlap():
    with packing_weights():
        arrays = [zeros_on_huge_pages((n, 33), np.uint8) for n in (1, 100, 64, 4000, 7)]
        copied = on_huge_pages(np.arange(12, dtype=np.int16).reshape(3, 4))
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert all(a.ctypes.data % 64 == 0 and not a.any() for a in arrays)
    for i, a in enumerate(arrays):
        a[...] = i + 1
    assert [int(a.max()) for a in arrays] == [1, 2, 3, 4, 5]  # no array wrote over another
    np.testing.assert_array_equal(copied, np.arange(12).reshape(3, 4))
    outside = on_huge_pages(np.ones((2, 2), np.float32))
    assert outside.base is None or not isinstance(outside.base, mmap.mmap)  # no arena outside


def test_a_region_is_unmapped_with_the_last_array_in_it():
    with packing_weights():
        arrays = [zeros_on_huge_pages((HUGE_PAGE,), np.uint8) for _ in range(8)]  # 16 MiB of one region
    first, view = arrays[0].ctypes.data, arrays[3][:10]
    del arrays
    gc.collect()
    assert _is_mapped(first)  # a view of one array keeps its whole region mapped
    del view
    gc.collect()
    assert not _is_mapped(first)


@pytest.mark.skipif(_thp_mode() == "never", reason="the kernel gives no transparent huge pages here")
def test_the_kernel_backs_them_with_huge_pages():
    """What the speed comes from: touched, a 16 MiB array raises the process's huge-page memory."""
    before = _anon_huge_kb()
    array = zeros_on_huge_pages((8 * HUGE_PAGE,), np.uint8)
    array[::4096] = 1  # touch every page
    # at least one huge page (on a fragmented machine the kernel may fall back to small ones for some)
    assert _anon_huge_kb() - before >= 2048


def _rss_kb_of(array: np.ndarray) -> int:
    """Resident kB of the mapping that holds ``array``'s first byte."""
    address, rss, inside = array.ctypes.data, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                rss = int(line.split()[1])
    return rss


def test_a_released_kv_cache_reads_zeros_and_holds_no_memory():
    """A warm spare's cache after its warm-up (PagedKVCache.release): every array's pages go back to the
    kernel (what its head-major layout and huge pages made resident by one block's writes), it reads as
    zeros, and it is writable again; an array sharing its region with others is left alone."""
    from fdcore.checkpoint import ModelArgs
    from fdcore.models.kv_cache import PagedKVCache
    from fdcore.models.tensors import release_pages

    args = ModelArgs.from_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 512,
            "vocab_size": 1000,
        },
        "test",
    )
    cache = PagedKVCache(args, 512, 16)
    for array in cache.k + cache.v:
        array[:, 0] = 1.0  # block 0 of each head, as the warm-up writes
        assert _rss_kb_of(array) * 1024 >= array.nbytes // 2
    cache.release()
    for array in cache.k + cache.v:
        assert _rss_kb_of(array) == 0
        assert not array.any()
    cache.k[0][:, 3] = 2.0
    assert cache.k[0][:, 3].min() == 2.0
    with packing_weights():
        shared_region = zeros_on_huge_pages((1024,), np.float32)
    shared_region[:] = 1.0
    assert not release_pages(shared_region) and shared_region.min() == 1.0
