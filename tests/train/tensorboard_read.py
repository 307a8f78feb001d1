"""Reads a TensorBoard directory that loom wrote, independently of loom's C++: the TFRecord framing
and its masked CRC-32Cs with Python's crc32c package, the events with Python's protobuf runtime
(the project's .proto compiled by protoc --python_out). Checks each file's framing and first
record (file_version "brain.Event:2"), that no (tag, step) appears twice across the files, and
that the scalars equal metrics.jsonl of the same run as float32: loss, lr, grad_norm,
tokens_per_s, mfu, peak_allocated_bytes per step, val_loss per validation, the same steps.

usage: tensorboard_read.py PB2_DIR TB_DIR JSONL [--files N] [--config STEP=TOML_FILE ...]
                           [--start STEP]
  --files N             the directory must hold N event files
  --config STEP=FILE    a "config" text at STEP holding FILE's TOML (in a Markdown code block)
  --start STEP          the last file's second record is a SessionLog START at STEP
Prints one line of what it read; exits 1 naming the first thing wrong.
"""
import argparse
import json
import os
import struct
import sys

import crc32c

SCALARS = ["loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_allocated_bytes"]


def fail(msg):
    print(f"tensorboard_read: FAIL: {msg}")
    sys.exit(1)


def masked(data):
    c = crc32c.crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    data = open(path, "rb").read()
    at = 0
    out = []
    while at < len(data):
        if len(data) - at < 12:
            fail(f"{path}: {len(data) - at} stray bytes at {at}")
        (length,) = struct.unpack_from("<Q", data, at)
        (length_crc,) = struct.unpack_from("<I", data, at + 8)
        if length_crc != masked(data[at : at + 8]):
            fail(f"{path}: the length CRC of the record at {at} does not match")
        end = at + 12 + length
        if end + 4 > len(data):
            fail(f"{path}: the record at {at} is cut short")
        (data_crc,) = struct.unpack_from("<I", data, end)
        if data_crc != masked(data[at + 12 : end]):
            fail(f"{path}: the data CRC of the record at {at} does not match")
        out.append(data[at + 12 : end])
        at = end + 4
    return out


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pb2_dir")
    ap.add_argument("tb_dir")
    ap.add_argument("jsonl")
    ap.add_argument("--files", type=int)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--start", type=int)
    a = ap.parse_args()
    sys.path.insert(0, a.pb2_dir)
    from train import tensorboard_event_pb2 as pb

    names = sorted(n for n in os.listdir(a.tb_dir) if "tfevents" in n)
    if a.files is not None and len(names) != a.files:
        fail(f"{a.tb_dir}: {len(names)} event files, expected {a.files}: {names}")
    scalars = {}  # (tag, step) -> value
    texts = {}  # step -> text
    n_events = 0
    last_file_events = []
    for name in names:
        events = []
        for r in records(os.path.join(a.tb_dir, name)):
            e = pb.Event()
            e.ParseFromString(r)
            events.append(e)
        n_events += len(events)
        if not events or events[0].WhichOneof("what") != "file_version":
            fail(f"{name}: the first record is not a file_version")
        if events[0].file_version != "brain.Event:2":
            fail(f"{name}: file_version '{events[0].file_version}', expected 'brain.Event:2'")
        for e in events[1:]:
            if e.WhichOneof("what") != "summary":
                continue
            for v in e.summary.value:
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    if (v.tag, e.step) in scalars:
                        fail(f"{name}: '{v.tag}' at step {e.step} a second time")
                    scalars[(v.tag, e.step)] = v.simple_value
                elif kind == "tensor" and v.tag == "config":
                    if v.metadata.plugin_data.plugin_name != "text":
                        fail(f"{name}: the config's plugin is '{v.metadata.plugin_data.plugin_name}'")
                    if v.tensor.dtype != pb.DT_STRING or len(v.tensor.string_val) != 1:
                        fail(f"{name}: the config is not one string")
                    if e.step in texts:
                        fail(f"{name}: a second config text at step {e.step}")
                    texts[e.step] = v.tensor.string_val[0].decode()
        last_file_events = events

    want = {}
    for line in open(a.jsonl):
        j = json.loads(line)
        if "val_loss" in j:
            want[("val_loss", j["step"])] = j["val_loss"]
        else:
            for k in SCALARS:
                want[(k, j["step"])] = j[k]
    if set(scalars) != set(want):
        fail(f"(tag, step) pairs differ: only in TensorBoard {sorted(set(scalars) - set(want))}, "
             f"only in {a.jsonl} {sorted(set(want) - set(scalars))}")
    for key, v in want.items():
        got = scalars[key]
        if v is None:  # JSON's null: not finite
            if got == got and abs(got) != float("inf"):
                fail(f"{key}: {got} in TensorBoard, null in {a.jsonl}")
        elif got != f32(v):
            fail(f"{key}: {got} in TensorBoard, {v} (float32 {f32(v)}) in {a.jsonl}")

    for c in a.config:
        step, path = c.split("=", 1)
        expect = "```toml\n" + open(path).read() + "```"
        if texts.get(int(step)) != expect:
            fail(f"the config text at step {step}: {texts.get(int(step))!r}, expected {expect!r}")
    if a.start is not None:
        s = last_file_events[1] if len(last_file_events) > 1 else None
        if (s is None or s.WhichOneof("what") != "session_log"
                or s.session_log.status != pb.SessionLog.START or s.step != a.start):
            fail(f"{names[-1]}: the second record is not a SessionLog START at step {a.start}: {s}")
    steps = sorted({s for (t, s) in scalars if t == "loss"})
    print(f"tensorboard_read: {len(names)} files, {n_events} events, CRCs and file_version ok; "
          f"steps {steps[0] if steps else '-'}..{steps[-1] if steps else '-'} "
          f"({len(scalars)} scalars) equal {os.path.basename(a.jsonl)}; "
          f"config texts at steps {sorted(texts)}")


main()
