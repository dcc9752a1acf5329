"""A safetensors file's bytes, the same for the same tensors and metadata in every process.

``safetensors.torch.save`` keeps the metadata in a Rust ``HashMap`` and writes its keys in that map's order, which
is seeded per process: the same file came out with its metadata in another order on a rerun, so a file left by an
interrupted run never matched the one rendered again. This writes the format itself (the safetensors spec: an 8-byte
little-endian header length, the JSON header, then the tensors' bytes) with sorted keys, the metadata under
``__metadata__``, the tensors in name order, and the header padded with spaces to a multiple of 8 bytes as
safetensors pads it. Read with safetensors' own ``safe_open`` / ``load_file``.
"""

from __future__ import annotations

import json
import struct

import torch

#: torch dtype → the safetensors dtype name.
DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
ALIGN = 8


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The file holding `tensors` (CPU) and the string `metadata`."""
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    blobs, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()  # the machine's byte order: little-endian
        place = {"data_offsets": [offset, offset + len(blob)]}
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), **place}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)
