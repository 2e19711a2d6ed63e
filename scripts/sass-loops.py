#!/usr/bin/env python3
"""Loop sizes in a kernel's SASS, for kernel work without a GPU.

Prints, for every backward branch of a function, the instructions between its target label
and the branch, with counts of a few instruction kinds (LDG, DFMA, FFMA, F2F, DADD, BSSY,
UMOV). The hot loop is usually the largest one. The count is static (unrolled bodies and cold
paths included), so compare two builds of the same loop rather than read absolute costs.

Getting the SASS (CUDA 13, no GPU needed):
  1. PTX: run the NVRTC check with the dump folder set, in the environment of
     scripts/nvrtc-check.sh (LD_LIBRARY_PATH and PAGODA_CUDA_INCLUDE pointing into its venv):
       PAGODA_NVRTC_CHECK=1 PAGODA_NVRTC_ONLY=sampling PAGODA_NVRTC_DUMP=/tmp/ptx \\
           cargo test -p pagoda-ops --features cuda --test nvrtc_check
  2. cubin: target/nvrtc-venv/.../nvidia/cu13/bin/ptxas -arch=sm_90a FILE.ptx -o k.cubin
  3. SASS: nvdisasm -c k.cubin > k.sass, with nvdisasm from the PyPI wheel
     nvidia-cuda-nvdisasm (13.2 or later; install it in a separate venv).
  4. One function: awk '/\\.text\\.NAME:/{f=1} /\\.text\\.NEXT:/{f=0} f' k.sass > name.sass

Usage: scripts/sass-loops.py name.sass
"""
import re
import sys

KINDS = ["LDG", "DFMA", "FFMA", "F2F", "DADD", "BSSY", "UMOV"]


def main(path):
    labels, instructions = {}, []
    for line in open(path):
        label = re.match(r"^\.(L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        instruction = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if instruction:
            instructions.append(instruction.group(1).strip())
    for end, text in enumerate(instructions):
        branch = re.search(r"BRA.*`\(\.(L_x_\d+)\)", text)
        if not branch or labels.get(branch.group(1), end + 1) > end:
            continue
        start = labels[branch.group(1)]
        body = instructions[start : end + 1]
        if len(body) > 20:
            counts = ", ".join(f"{kind} {sum(kind in x for x in body)}" for kind in KINDS)
            print(f"loop {start}-{end}: {len(body)} instructions, {counts}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: scripts/sass-loops.py FUNCTION.sass")
    main(sys.argv[1])
