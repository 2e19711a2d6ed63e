#!/usr/bin/env python3
"""Writes a GGUF holding another GGUF's metadata (tokenizer, chat template, hyperparameters)
and no tensors: a few MB instead of the whole model.

    python3 scripts/gguf-metadata-only.py models/SmolLM2-135M-Instruct.Q4_1.gguf .devc/tok.gguf

Served with `pagoda serve --random-weights PRESET -m tok.gguf`: random weights of the preset's
shape, the source model's tokenizer and template (how the GPU benches get the default model's
vocabulary on a machine that cannot take the model along).
"""
import sys

import gguf


def field_value(field):
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        inner = field.types[1]
        items = [field.parts[i] for i in field.data]
        if inner == gguf.GGUFValueType.STRING:
            return [bytes(x).decode("utf-8", errors="surrogateescape") for x in items], kind
        return [x.tolist()[0] for x in items], kind
    part = field.parts[field.data[0]]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="surrogateescape"), kind
    return part.tolist()[0], kind


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: gguf-metadata-only.py SRC.gguf DST.gguf")
    src, dst = sys.argv[1:]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"]
    arch_name = bytes(arch.parts[arch.data[0]]).decode()
    writer = gguf.GGUFWriter(dst, arch_name)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, kind = field_value(field)
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
