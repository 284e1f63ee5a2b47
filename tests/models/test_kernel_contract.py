"""The contract between fdcore's C++ operators and Python is written once, in kernels.h: the one-call
decoder's enums (Kind, Slot, kMeta) that Python mirrors, and every function one kernel file calls in another."""

from __future__ import annotations

import os
import re

from fdcore.models import kernels

HEADER = os.path.join(kernels.HERE, "kernels.h")


def _snake(name: str) -> str:
    """kGateUpScales -> gate_up_scales; kFloat32 -> float32."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name[1:]).lower()


def _enum(text: str, name: str) -> list[str]:
    body = re.search(rf"enum {name}\b[^{{]*\{{([^}}]*)\}}", text).group(1)
    return [entry.split("=")[0].strip() for entry in body.split(",") if entry.strip()]


def test_python_mirrors_the_decoders_enums_in_kernels_h():
    text = open(HEADER).read()
    kinds = _enum(text, "Kind")
    assert [_snake(k) for k in kinds] == list(kernels.DECODER_KINDS)
    values = [int(v) for v in re.findall(r"k\w+ = (\d+)", re.search(r"enum Kind\b[^{]*\{([^}]*)\}", text).group(1))]
    assert values == list(range(len(kinds)))
    slots = _enum(text, "Slot")
    assert slots[-1] == "kSlots" and [_snake(s) for s in slots[:-1]] == list(kernels.DECODER_SLOTS)
    assert int(re.search(r"constexpr int kMeta = (\d+);", text).group(1)) == len(kernels.DECODER_META)


def test_the_model_packs_its_matrices_with_the_headers_kind_codes():
    from fdcore.models import matrices as llama

    names = {
        llama.F32Matrix: "float32",
        llama.Bf16Matrix: "bfloat16",
        llama.Int8Matrix: "int8",
        llama.Int4Matrix: "int4",
    }
    assert {kernels.DECODER_KINDS[code]: names[matrix] for matrix, code in llama.KIND_CODES.items()} == {
        kind: kind for kind in kernels.DECODER_KINDS
    }


def test_no_kernel_file_declares_what_another_defines():
    """Every cross-file prototype is in kernels.h: a .cc file declares no function it does not define."""
    declared = re.compile(r"^(?:extern\s+(?!\"C\")|__attribute__\S*\s+)?[\w:<>]+\s+\**(\w+)\([^;{]*\);", re.M)
    for name in sorted(os.listdir(kernels.HERE)):
        if name.endswith(".cc"):
            text = open(os.path.join(kernels.HERE, name)).read()
            stray = [
                m.group(1)
                for m in declared.finditer(text)
                if not re.search(rf"\b{m.group(1)}\([^;]*\)\s*(const\s*)?\{{", text)
            ]
            assert not stray, f"{name} declares {stray}: prototypes shared between files belong in kernels.h"
