"""A script's local weights on a fake run: their shapes and dtypes read from the files, no bytes read.

A model the script loads from a local folder (`from_pretrained("path/to/model")`, a safetensors file) would have
its weights read for real, gigabytes of them, then turned into fake tensors. While the script runs on fake tensors,
safetensors' `safe_open` (and every library's reference to it: transformers' `modeling_utils.safe_open`) answers
from the file's header only (the format: an 8-byte little-endian header length, then a JSON header of each tensor's
dtype, shape and offsets; github.com/huggingface/safetensors, README "Format"): `get_tensor` and a slice's
`[...]` give a new tensor of that dtype and shape, made by `torch.empty`, so a fake one, allocated where the script
loads it, as on a GPU (a checkpoint loaded onto the device). (A real CPU run maps the file instead: its weights are
not allocated by torch until first used, so a CPU measurement's load phase is lower; the peak is the same.)
"""

from __future__ import annotations

import json
import struct
import sys

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
HEADER_LIMIT = 100 << 20  # bytes: safetensors' own limit on a header


def read_header(path) -> tuple[dict, dict]:
    """(tensors: name -> {"dtype", "shape"}, the file's metadata), from the header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > HEADER_LIMIT:
            raise ValueError(f"{path}: a safetensors header of {size} bytes is over the format's limit")
        header = json.loads(f.read(size))
    meta = header.pop("__metadata__", None) or {}
    return header, meta


class _Slice:
    def __init__(self, info: dict) -> None:
        self.info = info

    def get_shape(self) -> list[int]:
        return list(self.info["shape"])

    def get_dtype(self) -> str:
        return self.info["dtype"]

    def __getitem__(self, index):
        return torch.empty(self.info["shape"], dtype=DTYPES[self.info["dtype"]])[index]


class FakeSafeOpen:
    """`safetensors.safe_open` from the header: no tensor bytes are read."""

    def __init__(self, filename, framework: str = "pt", device="cpu", **kwargs) -> None:
        self.tensors, self.meta = read_header(filename)

    def __enter__(self) -> "FakeSafeOpen":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def offset_keys(self) -> list[str]:
        return sorted(self.tensors, key=lambda k: self.tensors[k]["data_offsets"][0])

    def metadata(self) -> dict:
        return self.meta

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        return torch.empty(info["shape"], dtype=DTYPES[info["dtype"]])


class header_only_weights:
    """While active, every module attribute that is safetensors' `safe_open` is `FakeSafeOpen`, and
    `safetensors.torch.load_file` reads headers only."""

    def __enter__(self) -> "header_only_weights":
        self.saved = []
        st = sys.modules.get("safetensors")
        if st is None:
            return self
        originals = {id(st.safe_open)}
        for module in list(sys.modules.values()):
            attrs = getattr(module, "__dict__", None)
            if isinstance(attrs, dict):
                for name, value in list(attrs.items()):
                    if id(value) in originals:
                        self.saved.append((module, name, value))
                        setattr(module, name, FakeSafeOpen)
        stt = sys.modules.get("safetensors.torch")
        if stt is not None:
            self.saved.append((stt, "load_file", stt.load_file))
            stt.load_file = lambda filename, device="cpu": {k: FakeSafeOpen(filename).get_tensor(k)
                                                             for k in read_header(filename)[0]}
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in self.saved:
            setattr(owner, name, value)
