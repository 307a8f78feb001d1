#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz/ from the files tests/fuzz/make_corpus.sh made with loom.

make_corpus.py TMP OUT: TMP holds tok.json, data/, ck/step-00000002/, tiny.json, resolved.toml.
"""
import base64
import glob
import json
import os
import shutil
import struct
import sys

tmp, out = sys.argv[1], sys.argv[2]
src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def put(harness, name, data):
    d = os.path.join(out, harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def read(path):
    with open(path, "rb") as f:
        return f.read()


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, raw bytes)] -> the file's bytes (header padded to 8)."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


# Safetensors: loom's own checkpoint files, and the other dtypes and shapes.
ck = os.path.join(tmp, "ck", "step-00000002")
put("fuzz_safetensors", "rank-00000.safetensors", read(os.path.join(ck, "rank-00000.safetensors")))
f32 = struct.pack("<6f", 1, -2, 0.5, 3, 1e-3, -7)
put("fuzz_safetensors", "dtypes.safetensors", safetensors([
    ("a", "F32", [2, 3], f32),
    ("b", "BF16", [3], struct.pack("<3H", 0x3F80, 0xC000, 0x7F80)),
    ("c", "F16", [2, 1], struct.pack("<2H", 0x3C00, 0x0001)),
    ("d", "I32", [2], struct.pack("<2i", 7, -1)),
    ("e", "U8", [0], b""),
    ("s", "F32", [], struct.pack("<f", 2.0)),
], {"format": "pt", "step": "3"}))
put("fuzz_safetensors", "empty.safetensors", safetensors([]))

# A sharded model's index, naming the shards the harness writes (a.weight; b.weight, c.weight).
put("fuzz_safetensors_index", "index.json", json.dumps({
    "metadata": {"total_size": 36},
    "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                   "b.weight": "model-00002-of-00002.safetensors",
                   "c.weight": "model-00002-of-00002.safetensors"}}, indent=2))
put("fuzz_safetensors_index", "one.json",
    json.dumps({"weight_map": {"c.weight": "model-00002-of-00002.safetensors"}}))

# config.json: the repo's model configs and the checkpoint's.
for p in sorted(glob.glob(os.path.join(src, "configs", "*.json"))):
    put("fuzz_llama_config", os.path.basename(p), read(p))
put("fuzz_llama_config", "checkpoint_config.json", read(os.path.join(ck, "config.json")))

# Job configs: the repo's TOML files, every key resolved, and overrides after a NUL byte.
for p in sorted(glob.glob(os.path.join(src, "configs", "*.toml"))):
    put("fuzz_job_config", os.path.basename(p), read(p))
put("fuzz_job_config", "resolved.toml", read(os.path.join(tmp, "resolved.toml")))
put("fuzz_job_config", "overrides", read(os.path.join(src, "configs", "debug.toml")) + b"\0" +
    b"--training.steps=7\n--optimizer.lr=1e-4\n--job.name='x=y'\n--parallelism.dp_shard=-1\n"
    b"--checkpoint.resume=true\n--activation_checkpoint.mode=selective\n"
    b"--job.collective_timeout_s=2.5")

# Tokenizers: loom's trained tokenizer.json, the same vocabulary as tiktoken ranks and as GPT-2's
# encoder.json + vocab.bpe.
tok_bytes = read(os.path.join(tmp, "tok.json"))
put("fuzz_tokenizer_json", "tokenizer.json", tok_bytes)
tok = json.loads(tok_bytes)
small = json.loads(tok_bytes)
keep = 256 + 8
small["model"]["vocab"] = {k: v for k, v in tok["model"]["vocab"].items() if v < keep}
small["model"]["merges"] = tok["model"]["merges"][:keep - 256]
small["added_tokens"] = [{"id": keep, "content": "<|endoftext|>", "special": True}]
put("fuzz_tokenizer_json", "small.json", json.dumps(small))

# GPT-2's byte <-> unicode table.
bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
    list(range(ord("®"), ord("ÿ") + 1))
cs = bs[:]
n = 0
for b in range(256):
    if b not in bs:
        bs.append(b)
        cs.append(256 + n)
        n += 1
unbyte = {chr(c): b for b, c in zip(bs, cs)}
ranks = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
tiktoken = "".join(base64.b64encode(bytes(unbyte[ch] for ch in t)).decode() + f" {r}\n"
                   for t, r in ranks)
put("fuzz_tiktoken", "ranks.tiktoken", tiktoken)
put("fuzz_tiktoken", "bytes.tiktoken", "".join(
    base64.b64encode(bytes([b])).decode() + f" {b}\n" for b in range(256)))
merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
encoder = dict(tok["model"]["vocab"])
encoder["<|endoftext|>"] = len(encoder)
put("fuzz_gpt2_vocab", "gpt2", json.dumps(encoder).encode() + b"\0" +
    ("#version: 0.2\n" + "\n".join(merges) + "\n").encode())
put("fuzz_gpt2_vocab", "small", json.dumps({k: v for k, v in encoder.items() if v < 260}).encode() +
    b"\0" + ("#version: 0.2\n" + "\n".join(merges[:4]) + "\n").encode())

# Token shards: loom's train and val shards, and an empty one.
for p in sorted(glob.glob(os.path.join(tmp, "data", "*.bin"))):
    put("fuzz_token_shard", os.path.basename(p), read(p))
put("fuzz_token_shard", "empty.bin",
    b"LOOMTOKS" + struct.pack("<IIQQ", 1, 4, 100000, 0) + b"\0" * 32)

# Checkpoint state.json.
put("fuzz_checkpoint_state", "state.json", read(os.path.join(ck, "state.json")))
st = json.loads(read(os.path.join(ck, "state.json")))
st["step"] = 0
put("fuzz_checkpoint_state", "step0.json", json.dumps(st))
put("fuzz_checkpoint_state", "dirname", b"step-00000007\n" + json.dumps(st).encode())
