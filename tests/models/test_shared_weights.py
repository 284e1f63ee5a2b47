"""A rank's packed weights in one shared-memory file (fdcore.models.shared_weights): packed once, mapped
read-only by every other process of the rank, the same logits to the bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fdcore.checkpoint import Checkpoint, inspect_checkpoint, load_checkpoint, tiny
from fdcore.core.batch import BatchInput
from fdcore.models.kv_cache import PagedKVCache
from fdcore.models.llama import LlamaModel
from fdcore.models.shared_weights import EMPTY, PRIVATE, PUBLISHED, WeightFile
from tests import DATA

pytestmark = [pytest.mark.tree, pytest.mark.kernels]

REFERENCE = json.load(open(os.path.join(DATA, "reference.json")))
BLOCK = 16
RESERVE = 1 << 30


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        name: tiny.make_tiny_model(str(root / name), **spec["options"])
        for name, spec in REFERENCE["checkpoints"].items()
    }


@pytest.fixture
def weight_fd():
    fd = os.memfd_create("fdcore-test-weights", os.MFD_CLOEXEC)
    yield fd
    os.close(fd)


def logits(model: LlamaModel) -> np.ndarray:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 4000, size=n).tolist() for n in (33, 1, 17)]
    tables = [list(range(i, 48, len(prompts)))[:6] for i in range(len(prompts))]
    cache = PagedKVCache(model.args, 48, BLOCK, "float32")
    prefill = model.forward(BatchInput(prompts, [0] * len(prompts), tables), cache)
    decode = model.forward(BatchInput([[9] for _ in prompts], [len(p) for p in prompts], tables), cache)
    return np.concatenate([prefill, decode])


def packed_into(fd: int, path: str, dtype: str, quantization: str) -> WeightFile:
    builder = WeightFile(fd)
    builder.lock()
    assert builder.state()[0] == EMPTY
    builder.begin(RESERVE)
    model = LlamaModel(load_checkpoint(path, progress=lambda *_: None), dtype, quantization, shared=builder)
    builder.unlock()
    return builder, model


def mapped_from(fd: int, path: str, dtype: str, quantization: str) -> LlamaModel:
    reader = WeightFile(fd)
    reader.lock()
    assert reader.state()[0] == PUBLISHED
    reader.attach()
    reader.unlock()
    model = LlamaModel(Checkpoint(path, inspect_checkpoint(path), (), {}), dtype, quantization, shared=reader)
    model.shared = reader
    return model


@pytest.mark.parametrize(
    "dtype, quantization", [("float32", "none"), ("float32", "wint8"), ("float32", "wint4"), ("bfloat16", "none")]
)
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-tied"])
def test_a_mapped_model_gives_the_packed_ones_logits_to_the_bit(checkpoints, weight_fd, name, dtype, quantization):
    from fdcore.models.kernels import kernel_path, missing_cpu_feature

    kind = dtype if quantization == "none" else quantization
    if kernel_path(kind) is None:
        pytest.skip(f"{kind} is refused on this CPU (needs {missing_cpu_feature(kind)})")
    private = LlamaModel(load_checkpoint(checkpoints[name], progress=lambda *_: None), dtype, quantization)
    builder, built = packed_into(weight_fd, checkpoints[name], dtype, quantization)
    mapped = mapped_from(weight_fd, checkpoints[name], dtype, quantization)
    expected = logits(private)
    assert np.array_equal(logits(built), expected)
    assert np.array_equal(logits(mapped), expected)
    # the mapped model's weights lie in the file (stored() refuses an array that does not)
    for array in (mapped.norm, mapped.layers[-1]["post_norm"]):
        mapped.shared.stored(array)
    with pytest.raises(ValueError, match="not in the weight file"):
        mapped.shared.stored(private.norm)


def test_the_mapped_weights_are_read_only(checkpoints, weight_fd):
    path = checkpoints["llama-gqa"]
    packed_into(weight_fd, path, "float32", "none")
    mapped = mapped_from(weight_fd, path, "float32", "none")
    with pytest.raises(ValueError, match="read-only"):
        mapped.norm[0] = 1.0


def test_a_builder_that_died_leaves_the_file_to_the_next_one(checkpoints, weight_fd, tmp_path):
    """The builder is SIGKILLed holding the lock halfway through its packing: the next process finds the
    file EMPTY (not half published), packs it again, and what it packs maps to the right logits."""
    path = checkpoints["llama-gqa"]
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import os, signal
        from fdcore.models import tensors
        from fdcore.models.llama import LlamaModel
        from fdcore.checkpoint import load_checkpoint
        from fdcore.models.shared_weights import WeightFile
        shared = WeightFile({weight_fd})
        shared.lock()
        shared.begin({RESERVE})
        taken = []
        def take(nbytes):
            taken.append(nbytes)
            if len(taken) == 3:  # a few arrays in: the file holds part of a model
                os.kill(os.getpid(), signal.SIGKILL)
            return shared.take(nbytes)
        original = tensors._Arena.__init__
        tensors._Arena.__init__ = lambda self, external=None: original(self, take)
        LlamaModel(load_checkpoint({path!r}, progress=lambda *_: None))
    """),
        ],
        pass_fds=(weight_fd,),
    )
    assert child.wait(timeout=120) == -signal.SIGKILL
    probe = WeightFile(weight_fd)
    probe.lock()
    assert probe.state()[0] == EMPTY
    probe.unlock()
    packed_into(weight_fd, path, "float32", "none")
    private = LlamaModel(load_checkpoint(path, progress=lambda *_: None))
    assert np.array_equal(logits(mapped_from(weight_fd, path, "float32", "none")), logits(private))


def test_a_file_without_room_keeps_the_builders_arrays_and_says_private(checkpoints, weight_fd):
    """The memory runs out midway (fallocate fails): the builder places the rest privately, its model
    is whole, and the file says PRIVATE with the reason, so the rank's other processes pack their own."""
    path = checkpoints["llama-gqa"]
    builder = WeightFile(weight_fd)
    builder.lock()
    builder.begin(RESERVE)
    calls = []
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        calls.append(offset)
        if len(calls) > 4:
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    os.posix_fallocate = fallocate
    try:
        model = LlamaModel(load_checkpoint(path, progress=lambda *_: None), shared=builder)
    finally:
        os.posix_fallocate = real
    assert builder.full is not None and "No space left" in builder.full
    builder.keep_private(builder.full)
    builder.unlock()
    private = LlamaModel(load_checkpoint(path, progress=lambda *_: None))
    assert np.array_equal(logits(model), logits(private))
    other = WeightFile(weight_fd)
    assert other.state() == (PRIVATE, builder.full)


def test_weights_packed_for_another_model_are_refused(checkpoints, weight_fd):
    path = checkpoints["llama-gqa"]
    packed_into(weight_fd, path, "float32", "none")
    reader = WeightFile(weight_fd)
    reader.attach()
    with pytest.raises(RuntimeError, match="packed for"):
        LlamaModel(Checkpoint(path, inspect_checkpoint(path), (), {}), "float32", "wint8", shared=reader)


def test_a_bfloat16_matrix_maps_to_the_same_bits(weight_fd):
    """The bfloat16 kind's round trip on every CPU (a bfloat16 model runs only where AVX512-BF16 is):
    its tensor goes into the file as int16 bits and comes back as the same bfloat16 tensor."""
    import paddle

    from fdcore.models.matrices import Bf16Matrix
    from fdcore.models.tensors import packing_weights
    from fdcore.models.weights_manifest import StoredMatrix, stored_value

    builder = WeightFile(weight_fd)
    builder.begin(RESERVE)
    weight = np.random.default_rng(5).standard_normal((70, 48)).astype(np.float32)
    with packing_weights(builder.take):
        matrix = Bf16Matrix.pack(weight)
    stored = StoredMatrix("Bf16Matrix", [stored_value(builder, matrix.packed)], matrix.rows)
    builder.publish(b"")
    reader = WeightFile(weight_fd)
    reader.attach()
    bits = reader.array(stored.parts[0])
    assert stored.parts[0].dtype == "bfloat16" and stored.parts[0].tensor
    assert np.array_equal(bits, np.from_dlpack(matrix.packed.view(paddle.int16)))
    assert paddle.to_tensor(bits).view(paddle.bfloat16).dtype == paddle.bfloat16


def test_page_size_is_measured_only_for_weights_that_leave_the_caches(checkpoints, monkeypatch):
    """A model whose layers fit in the caches is shared without a probe (a probe there reads only noise:
    CI's busy machine once measured the tiny model's 1 MB "32 % slower" and kept it private); a larger
    one is measured, over one matrix of its hidden width."""
    import dataclasses

    from fdcore.models import page_probe

    args = inspect_checkpoint(checkpoints["llama-gqa"])
    measured = []
    monkeypatch.setattr(page_probe, "f32_kernel", lambda: True)
    monkeypatch.setattr(page_probe, "shared_pages_cost", lambda stream, nbytes, fd: measured.append(nbytes) or 0.5)
    assert page_probe.shared_pages_slowdown(args) is None and measured == []
    large = dataclasses.replace(
        args, hidden_size=1024, intermediate_size=4096, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64
    )
    assert page_probe.shared_pages_slowdown(large) == 0.5 and measured and measured[0] >= page_probe.PAGE_COST_FLOOR


def test_the_weight_file_is_nameless_on_the_homes_filesystem_else_a_memfd(tmp_path):
    """A disk filesystem's page cache maps the weights on large folios where a memfd may get 4 KiB pages;
    either way nothing has a name that could outlive the tree."""
    from fdcore.supervisor import nameless_file

    fd = nameless_file(str(tmp_path / "home"), "fdcore-test-weights.r0")
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
        assert where.startswith(str(tmp_path / "home" / "#")) and where.endswith("(deleted)"), where
        assert os.listdir(tmp_path / "home") == []
    finally:
        os.close(fd)
    fd = nameless_file("/proc/self", "fdcore-test-weights.r0")  # (procfs makes no O_TMPFILE)
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fdcore-test-weights.r0")
    finally:
        os.close(fd)


def test_the_page_probe_streams_the_weight_files_own_pages_and_leaves_it_empty(tmp_path):
    """Whether shared pages cost speed depends on the file's own pages (a memfd's and a disk file's differ),
    so the probe borrows the weight file itself, and gives it back empty."""
    from fdcore.models.shared_weights import shared_pages_cost
    from fdcore.supervisor import nameless_file

    fd = nameless_file(str(tmp_path), "fdcore-test-weights.r0")
    inode = str(os.fstat(fd).st_ino)
    backing = []

    def stream(array):
        address = array.ctypes.data
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, *_, node = line.split()[:5]
                low, high = (int(x, 16) for x in span.split("-"))
                if low <= address < high:
                    backing.append(node)

    try:
        shared_pages_cost(stream, 4 << 20, fd)
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    assert inode in backing and any(node != inode for node in backing)  # the file's pages, and private ones
