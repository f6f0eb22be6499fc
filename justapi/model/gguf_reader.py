"""Parsing a GGUF file: gguf's GGUFReader over a plain view of the file's memory map, its metadata arrays cut in one
pass (the reader's own way runs Python per array element: seconds for a large vocabulary)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


class ModelLoadError(Exception):
    """A model file that cannot be served; the message names the file and the problem."""


def field_value(reader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python object (str, int, float, bool or list), or ``default`` if absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


@functools.cache
def reader_class():
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        """gguf's reader over a plain ndarray view of the file's memory map instead of the ``np.memmap`` itself:
        numpy's memmap subclass runs Python code on every slice, and the reader slices once per element of each
        metadata array, about 2.5 million times for a 49k-token vocabulary (2.9 of the 3.0 s it took to parse
        SmolLM2's file). The view shares the mapping and keeps it alive; nothing is read into memory."""

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):  # GGUFReader.__init__ assigns its memmap here
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            """The reader's own parts of a metadata array, cut from the mapping in one pass: the reader reads each
            element with two numpy calls of its own (5.4 of the 6.3 s Gemma 3's 262k-token vocabulary took). Arrays
            of anything but strings and scalars, and big-endian files, go the reader's way."""
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            types = [gguf.GGUFValueType.ARRAY] + ([itype] if n else [])
            if itype == gguf.GGUFValueType.STRING:
                return _string_array_parts(self.data, offs, n, [raw_itype, alen], types, orig_offs)
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:
                return super()._get_field_parts(orig_offs, raw_type)
            size = np.dtype(nptype).itemsize * n
            values = self.data[offs : offs + size].view(nptype)
            return 12 + size, [raw_itype, alen, *values.reshape(n, 1)], list(range(2, 2 + n)), types

    return PlainArrayReader


def _string_array_parts(data: np.ndarray, offs: int, n: int, parts: list, types: list, orig_offs: int):
    """gguf's parts of an array of ``n`` strings at ``offs`` (each its uint64 length, then its bytes)."""
    raw = memoryview(data)
    for _ in range(n):
        length = int.from_bytes(raw[offs : offs + 8], "little")
        parts.append(data[offs : offs + 8].view(np.uint64))
        parts.append(data[offs + 8 : offs + 8 + length])
        offs += 8 + length
    return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), types
