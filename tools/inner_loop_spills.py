"""Innermost loops of fdcore's built kernel library that store vector registers to the stack.

A kernel's accumulators belong in registers; when the compiler keeps them in memory instead (an array
captured by reference in a lambda was the case in the attention kernels), every iteration stores them again,
and the kernel slows without any change in its results. This disassembles the library (``objdump -d``),
finds each innermost loop (a backward jump with no other backward jump inside it) and prints those with
stores of zmm / ymm registers to stack slots. A heuristic: a range between a jump and its target can hold
code the loop jumps over (a tail handled once), so read the loop it points at (``objdump -d``) before
concluding. Arrays indexed at run time (a kernel's 16 keys' partial sums) are stored by design.

Usage: python tools/inner_loop_spills.py [LIBRARY.so] [--match NAME] [--least N]
(default: the library built for this CPU and these sources, fdcore.models.kernels.kernel_dir)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

INSTRUCTION = re.compile(r"\s*([0-9a-f]+):\s*(.*)")
BACKWARD_JUMP = re.compile(r"j\w+\s+([0-9a-f]+)")
STACK_STORE = re.compile(r"vmov\w*\s+%[yz]mm\d+,-?(0x[0-9a-f]+)?\(%r[sb]p")
STACK_LOAD = re.compile(r"vmov\w*\s+-?(0x[0-9a-f]+)?\(%r[sb]p[^)]*\),%[yz]mm")


def functions(library: str):
    """(name, [(address, instruction text)]) for each function of the library's disassembly."""
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", library], check=True, capture_output=True, text=True
    ).stdout
    for chunk in text.split("\n\n"):
        lines = chunk.strip().split("\n")
        head = re.search(r"<(.*)>:$", lines[0])
        if head:
            body = [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, lines[1:]) if m]
            yield head.group(1), body


def innermost_loops(body):
    """(start, end) address ranges of the loops that contain no other loop."""
    loops = []
    for address, text in body:
        jump = BACKWARD_JUMP.match(text)
        if jump and int(jump.group(1), 16) < address:
            loops.append((int(jump.group(1), 16), address))
    return [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", nargs="?", help="the .so to read (default: this machine's build)")
    parser.add_argument("--match", default="", help="only functions whose name contains this")
    parser.add_argument("--least", type=int, default=2, help="only loops with at least this many stack stores")
    opts = parser.parse_args(argv)
    library = opts.library
    if library is None:
        from fdcore.models.kernels import kernel_dir

        library = os.path.join(kernel_dir(), "fdcore_kernels", "fdcore_kernels.so")
    print(f"{'stores':>6s} {'loads':>6s} {'instructions':>12s}  function (innermost loop)")
    found = 0
    for name, body in functions(library):
        if opts.match not in name:
            continue
        for start, end in innermost_loops(body):
            loop = [text for address, text in body if start <= address <= end]
            stores = sum(1 for text in loop if STACK_STORE.match(text))
            if stores >= opts.least:
                loads = sum(1 for text in loop if STACK_LOAD.match(text))
                print(f"{stores:6d} {loads:6d} {len(loop):12d}  {name[:100]} @{start:x}")
                found += 1
    print(f"{found} loop(s) with >= {opts.least} vector stores to the stack in {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
