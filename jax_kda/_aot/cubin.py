"""Finds the CUDA ELF images (cubins) that export_to_c embeds as raw data in host objects.

cuobjdump looks for fatbin sections and does not see these, so the build check and the tests
cut them out of the object or shared library first. Stdlib only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

_ELF_MAGIC = b"\x7fELF"
_EM_CUDA = 190
_SHT_NOBITS = 8


def _image_size(data: bytes, at: int) -> int:
    """Bytes up to the end of the last section, section header table or program header table."""
    (phoff, shoff) = struct.unpack_from("<QQ", data, at + 32)
    (phentsize, phnum, shentsize, shnum) = struct.unpack_from("<HHHH", data, at + 54)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for i in range(shnum):
        header = at + shoff + i * shentsize
        (sh_type,) = struct.unpack_from("<I", data, header + 4)
        (offset, size) = struct.unpack_from("<QQ", data, header + 24)
        if sh_type != _SHT_NOBITS:
            end = max(end, offset + size)
    return end


def embedded_cubins(data: bytes) -> Iterator[bytes]:
    """Yields every 64-bit little-endian CUDA ELF image found inside `data`."""
    at = 0
    while (at := data.find(_ELF_MAGIC, at)) >= 0:
        is_cuda = (
            at + 64 <= len(data)
            and data[at + 4] == 2  # ELFCLASS64
            and data[at + 5] == 1  # little endian
            and struct.unpack_from("<H", data, at + 18)[0] == _EM_CUDA
        )
        if not is_cuda:
            at += 4
            continue
        size = _image_size(data, at)
        yield data[at : at + size]
        at += size


def cubin_sm(image: bytes) -> int:
    """The SM number a cubin was built for (90, 100, ...); two header encodings exist."""
    (flags,) = struct.unpack_from("<I", image, 48)
    abi_version = image[8]
    return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF
