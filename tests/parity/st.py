#!/usr/bin/python3
"""Minimal safetensors reader/writer in numpy (test and benchmark helper, not used by loom).

Format (Hugging Face safetensors): u64 little-endian header length N, then N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, padded with
spaces so the data starts 8-byte aligned, then the raw little-endian tensor bytes.

Supported dtypes: F32, F64, F16, BF16, I32. numpy has no bfloat16, so BF16 is read as float32 (exact)
and written from float32 with round-to-nearest-even; `load(..., raw_bf16=True)` returns the uint16 bits.
"""
import json
import struct

import numpy as np

_NP = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2"), "I32": np.dtype("<i4")}
_FROM_NP = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16",
            np.dtype("int32"): "I32"}
_SIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I32": 4}


def f32_to_bf16_bits(a):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    rounded = np.where(nan, (u >> 16) | 0x40, rounded)
    return rounded.astype("<u2")


def bf16_bits_to_f32(bits):
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def _header(path):
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        hdr = json.loads(f.read(n).decode("utf-8"))
    return hdr, 8 + n


def load(path, raw_bf16=False):
    """Returns {name: numpy array}. BF16 becomes float32 unless raw_bf16 (then uint16 bits)."""
    hdr, base = _header(path)
    with open(path, "rb") as f:
        data = f.read()
    out = {}
    for name, info in hdr.items():
        if name == "__metadata__":
            continue
        dt, shape = info["dtype"], tuple(info["shape"])
        b, e = info["data_offsets"]
        if dt not in _SIZE:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        count = int(np.prod(shape, dtype=np.int64))
        if e - b != count * _SIZE[dt]:
            raise ValueError(f"{path}: tensor {name}: {e - b} bytes for shape {shape} of {dt}")
        buf = data[base + b:base + e]
        if dt == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").reshape(shape)
            out[name] = bits.copy() if raw_bf16 else bf16_bits_to_f32(bits).reshape(shape)
        else:
            out[name] = np.frombuffer(buf, dtype=_NP[dt]).reshape(shape).copy()
    return out


def metadata(path):
    return _header(path)[0].get("__metadata__", {})


def save(path, tensors, dtypes=None, meta=None):
    """Writes {name: array}. dtypes: optional {name: "BF16"|"F16"|...} overriding the array's own
    dtype (arrays are converted; "BF16" rounds float values to bfloat16)."""
    dtypes = dtypes or {}
    hdr, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        dt = dtypes.get(name) or _FROM_NP.get(a.dtype)
        if dt is None:
            raise ValueError(f"tensor {name}: dtype {a.dtype} not supported (F32, F64, F16, BF16, I32)")
        if dt == "BF16":
            blob = (a if a.dtype == np.uint16 else f32_to_bf16_bits(a.astype(np.float32))).tobytes()
        else:
            blob = np.ascontiguousarray(a, dtype=_NP[dt]).tobytes()
        hdr[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    if meta:
        hdr["__metadata__"] = {str(k): str(v) for k, v in meta.items()}
    h = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-(8 + len(h))) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for blob in blobs:
            f.write(blob)
