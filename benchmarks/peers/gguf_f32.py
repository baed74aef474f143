"""Rewrite a GGUF with every tensor dequantized to F32, or its matrices rounded on to BF16
(metadata and tokenizer unchanged).

llama.cpp then runs exactly the float32 weights jaxinfer converts from the same GGUF (the
embedded SmolLM2 ships as Q4_1; `jaxinfer prepare-default-model` dequantizes it to fp32), so a
comparison measures the engines, not the quantization. Needs the `gguf` package (test extra).
BF16 (`bf16`): the weights a bfloat16 engine holds (jaxinfer / vLLM with dtype="bfloat16"
round the same float32 values to nearest even); 1-D tensors (norms) stay F32, as llama.cpp's
own converter leaves them.
Usage: python benchmarks/peers/gguf_f32.py IN.gguf OUT.gguf [f32|bf16]
"""

from __future__ import annotations

import sys

import numpy as np


def rewrite_f32(src: str, dst: str, kind: str = "f32") -> str:
    import gguf
    from gguf.quants import dequantize

    if kind not in ("f32", "bf16"):
        raise ValueError(f"kind={kind!r}: f32 or bf16")

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]).decode(), vtype)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF stores dims innermost first
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        add_weight(writer, t.name, w, kind)
    return write_out(writer, dst)


def add_weight(writer, name: str, w: np.ndarray, kind: str) -> None:
    """Float32 `w` into the GGUF as llama.cpp's converter stores it: a matrix BF16 when kind
    is "bf16", else (and 1-D tensors always) F32."""
    import gguf
    import ml_dtypes

    if kind == "bf16" and w.ndim >= 2:
        writer.add_tensor(name, w.astype(ml_dtypes.bfloat16).view(np.uint16),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, w)


def write_out(writer, dst: str) -> str:
    """The GGUF's header, metadata and tensors written to `dst`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


if __name__ == "__main__":
    print(rewrite_f32(sys.argv[1], sys.argv[2], *sys.argv[3:4]))
