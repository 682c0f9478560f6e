"""Read CTranslate2 `model.bin` files into torch tensors, without CTranslate2 itself.

Layout (little-endian, no padding): u32 binary_version; from version 2 a spec name and a u32 spec
revision; u32 variable count, then per variable a name, u8 rank, u32 dims[rank] and the data
description, then raw row-major bytes; from version 3 a list of aliases (name -> target name).
Version 4 and later describe data as (u8 dtype id, u32 byte count); older files as (u8 item size,
u32 element count) and the dtype is guessed from the item size, as CTranslate2 does.
Strings are u16 length (counting a trailing NUL), the UTF-8 bytes, then the NUL.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

# CTranslate2's DataType enum order.
_DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16,
           5: torch.bfloat16}
_DTYPE_BY_ITEM_SIZE = {4: torch.float32, 2: torch.int16, 1: torch.int8}
SUPPORTED_BINARY_VERSIONS = range(1, 7)


class UnsupportedQuantization(ValueError):
    """The checkpoint stores quantized weights (int8/int16) that this engine cannot run yet."""


@dataclass
class CT2Model:
    binary_version: int
    spec_name: str
    spec_revision: int
    variables: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> torch.Tensor:
        """A variable by name, following aliases (e.g. a tied output projection)."""
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return self.variables[name]

    def __contains__(self, name: str) -> bool:
        return name in self.variables or name in self.aliases


class _Reader:
    """Bounds-checked reads from a model.bin buffer: a truncated or malformed file is a ValueError
    naming `source` and what was being read, never a struct.error or UnicodeDecodeError."""

    def __init__(self, buf: memoryview | bytes | bytearray, source: object = "model.bin") -> None:
        self.buf = buf
        self.view = memoryview(buf)
        self.pos = 0
        self.source = source

    def unpack(self, fmt: str, what: str = "a header field"):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.source}: truncated at byte {self.pos} while reading {what}")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values if len(values) > 1 else values[0]

    def string(self, what: str = "a name") -> str:
        n = self.unpack("H", what)
        raw = bytes(self.take(n, what))
        try:
            return raw.rstrip(b"\0").decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.source}: {what} at byte {self.pos - n} is not UTF-8") from None

    def take(self, n: int, what: str = "data") -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.source}: truncated: {what} needs {n} bytes at byte {self.pos}, "
                             f"the file has {len(self.buf) - self.pos} left")
        view = self.view[self.pos:self.pos + n]
        self.pos += n
        return view


def read_spec_name(path: str | Path) -> str | None:
    """The spec name in a model.bin header ("WhisperSpec", "TransformerDecoderModelSpec", ...),
    reading only its first bytes; "" for version 1 files (they have none), None when the file is
    not a CTranslate2 model (too short, or a version we do not know)."""
    with open(path, "rb") as f:
        head = f.read(4 + 2 + 1024)
    if len(head) < 4:
        return None
    r = _Reader(head)
    version = r.unpack("I")
    if version not in SUPPORTED_BINARY_VERSIONS:
        return None
    if version < 2:
        return ""
    if len(head) < 6:
        return None
    n = r.unpack("H")
    if n == 0 or 6 + n > len(head) or head[6 + n - 1] != 0:
        return None   # a real spec name is short and NUL-terminated
    try:
        return bytes(head[6:6 + n - 1]).decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_ctranslate2(path: str | Path, allow_quantized: bool = False) -> CT2Model:
    """Read every variable of a CTranslate2 model.bin (a file or the folder holding it).

    Tensors are views into one in-memory copy of the file. int8/int16 weight matrices raise
    UnsupportedQuantization unless `allow_quantized` (then they are returned raw, with their
    `<name>_scale` variables alongside); other integer variables are config and always allowed.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    # One buffer for the whole file: tensors are views into it, so nothing is copied twice.
    buf = bytearray(path.stat().st_size)
    with open(path, "rb") as f:
        f.readinto(buf)
    r = _Reader(buf, path)
    version = r.unpack("I", "the binary version")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise ValueError(f"{path}: CTranslate2 binary version {version} is not supported "
                         f"(supported: {SUPPORTED_BINARY_VERSIONS.start}.."
                         f"{SUPPORTED_BINARY_VERSIONS.stop - 1})")
    spec_name, revision = "", 1
    if version >= 2:
        spec_name = r.string("the spec name")
        revision = r.unpack("I", "the spec revision")
    model = CT2Model(version, spec_name, revision)
    quantized = []
    for _ in range(r.unpack("I", "the variable count")):
        name = r.string("a variable name")
        rank = r.unpack("B", f"{name!r}'s rank")
        shape = [r.unpack("I", f"{name!r}'s shape") for _ in range(rank)]
        if version >= 4:
            type_id = r.unpack("B", f"{name!r}'s dtype")
            if type_id not in _DTYPES:
                raise ValueError(f"{path}: variable {name!r} has unknown dtype id {type_id}")
            dtype = _DTYPES[type_id]
            num_bytes = r.unpack("I", f"{name!r}'s byte count")
        else:
            item_size = r.unpack("B", f"{name!r}'s item size")
            if item_size not in _DTYPE_BY_ITEM_SIZE:
                raise ValueError(f"{path}: variable {name!r} has item size {item_size} (not 1, 2 or 4)")
            dtype = _DTYPE_BY_ITEM_SIZE[item_size]
            num_bytes = r.unpack("I", f"{name!r}'s element count") * item_size
        data = r.take(num_bytes, f"variable {name!r}")
        # the shape must account for the bytes exactly (else reshape fails, or views are misread)
        if math.prod(shape) * dtype.itemsize != num_bytes:
            raise ValueError(f"{path}: variable {name!r} has shape {shape} of {dtype} but {num_bytes} bytes")
        # Integer scalars/vectors are config (num_heads, activation...); integer weights are
        # quantized.
        if dtype in (torch.int8, torch.int16) and name.endswith("weight"):
            quantized.append((name, "int8" if dtype == torch.int8 else "int16"))
            if not allow_quantized:
                continue
        tensor = torch.frombuffer(data, dtype=dtype) if num_bytes else \
            torch.empty(0, dtype=dtype)
        model.variables[name] = tensor.reshape(shape)
    if quantized and not allow_quantized:
        name, kind = quantized[0]
        raise UnsupportedQuantization(
            f"{path}: the weights are quantized ({kind}, e.g. {name!r}); "
            "int8/int16 CTranslate2 models are not yet supported. Use a float16, bfloat16 or "
            "float32 conversion (ct2-transformers-converter --quantization float16).")
    if version >= 3:
        for _ in range(r.unpack("I", "the alias count")):
            alias = r.string("an alias")
            model.aliases[alias] = r.string("an alias target")
    return model
