"""The kernels' code paths by CPU: the library is built for the CPU it runs on (``-march=native``, cached
by its /proc/cpuinfo flags), or for AVX2 + FMA only under ``FDCORE_ISA=avx2`` (how an AVX-512 machine
runs the paths of an AVX2-only one). The linear kernels and the sampler compute the same integers and the
same float32 operations on either path, so they give the same bits: a checkpoint's outputs do not
depend on which of the two a machine takes (attention sums in another order on AVX2, and is only
bit-stable within one build)."""

from __future__ import annotations

import numpy as np
import pytest

from fdcore.models import kernels

pytestmark = pytest.mark.kernels

_PATHS = """
import sys
import numpy as np
import paddle
from fdcore.models import kernels
from fdcore.models.matrices import F32Matrix, Int4Matrix, Int8Matrix, f32_kernel, matrix_kind, linear
assert f32_kernel()
matrix_kind("float32", "wint4")  # loads both int kernels
data = np.load(sys.argv[1])
out = {"paths": np.array([kernels.kernel_path(kind) for kind in ("float32", "wint8", "wint4")])}
for kind, cls in (("f32", F32Matrix), ("int8", Int8Matrix), ("int4", Int4Matrix)):
    matrix = cls.pack(data["w"])
    for m in (1, 3, 37):
        out[f"{kind}-{m}"] = linear(paddle.to_tensor(data["x"][:m]), matrix).numpy()
out["tokens"] = kernels.gumbel_sample()(paddle.to_tensor(data["logits"]), paddle.to_tensor(data["keys"]),
                                        paddle.to_tensor(data["inv_t"])).numpy()
np.savez(sys.argv[2], **out)
"""


def test_the_isa_variable_caps_the_flags_and_names_itself(monkeypatch):
    monkeypatch.setattr(kernels.cpu, "cpu_flags", lambda: "avx2 avx512_bf16 avx512_vnni avx512bw avx512f f16c fma sse2")
    assert kernels.kernel_path("wint8") == "AVX512-VNNI" and kernels.kernel_path("bfloat16") == "AVX512-BF16"
    monkeypatch.setenv("FDCORE_ISA", "avx2")
    assert kernels.kernel_flags() == {"avx2", "f16c", "fma", "sse2"}
    assert kernels.kernel_path("wint8") == "AVX2" and kernels.kernel_path("float32") == "AVX2"
    assert kernels.missing_cpu_feature("bfloat16") == "AVX512-BF16"
    monkeypatch.setenv("FDCORE_ISA", "avx9")
    with pytest.raises(ValueError, match=r"FDCORE_ISA='avx9': 'native' \(the default\) or 'avx2'"):
        kernels.kernel_flags()


@pytest.mark.skipif(kernels.kernel_path("wint8") is None, reason="no AVX2 here: no kernel path to compare")
def test_the_avx2_build_gives_this_builds_bits(on_threads):
    """The same products (float32, wint8, wint4; 1, 3 and 37 rows: every tile and tail) and the same
    sampled tokens from a library built for AVX2 only as from this CPU's own build (on an AVX-512 CPU:
    AVX-512 against AVX2 code; on an AVX2 one: two builds of the AVX2 code)."""
    import paddle

    from fdcore.models.matrices import F32Matrix, Int4Matrix, Int8Matrix, f32_kernel, linear, matrix_kind

    rng = np.random.default_rng(5)
    arrays = {
        "x": rng.standard_normal((37, 200)).astype(np.float32),
        "w": rng.standard_normal((100, 200)).astype(np.float32),
        "logits": (rng.standard_normal((5, 1003)) * 3).astype(np.float32),
        "keys": rng.integers(0, 2**62, size=5, dtype=np.int64),
        "inv_t": np.array([1.0, 0.5, 2.0, 1.3, 0.7], dtype=np.float32),
    }
    avx2 = on_threads(_PATHS, arrays, threads=1, env={"FDCORE_ISA": "avx2"})
    assert avx2["paths"].tolist() == ["AVX2", "AVX2", "AVX2"]
    assert f32_kernel()
    matrix_kind("float32", "wint4")
    for kind, cls in (("f32", F32Matrix), ("int8", Int8Matrix), ("int4", Int4Matrix)):
        matrix = cls.pack(arrays["w"])
        for m in (1, 3, 37):
            here = linear(paddle.to_tensor(arrays["x"][:m]), matrix).numpy()
            assert np.array_equal(avx2[f"{kind}-{m}"], here), (kind, m)
    tokens = kernels.gumbel_sample()(
        paddle.to_tensor(arrays["logits"]), paddle.to_tensor(arrays["keys"]), paddle.to_tensor(arrays["inv_t"])
    ).numpy()
    assert np.array_equal(avx2["tokens"], tokens)
