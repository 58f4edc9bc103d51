"""The NCCL slimmer (`benchmarks.slim_nccl`) on synthetic fatbins in a
synthetic ELF file: only the kept architecture's device code survives, every
header stays, and layouts it cannot read are refused."""

import lzma
import struct
import sys

import pytest

from benchmarks import slim_nccl

ENTRY_HEADER = 64


def _entry(arch: int, payload: bytes) -> bytes:
  header = bytearray(ENTRY_HEADER)
  struct.pack_into("<HHIQ", header, 0, 2, 0x101, ENTRY_HEADER, len(payload))
  struct.pack_into("<I", header, 28, arch)
  return bytes(header) + payload


def _fatbin(*entries: bytes) -> bytes:
  body = b"".join(entries)
  return struct.pack("<IHHQ", slim_nccl.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(sections: dict[bytes, bytes]) -> bytes:
  """A little-endian ELF64 file holding `sections` (and the section names)."""
  names = b"\0" + b"".join(name + b"\0" for name in [*sections, b".shstrtab"])
  blobs = [*sections.values(), names]
  data = bytearray(64)
  offsets = []
  for blob in blobs:
    data += bytes(-len(data) % 8)
    offsets.append(len(data))
    data += blob
  data += bytes(-len(data) % 8)
  shoff = len(data)
  headers = [bytes(64)]  # the null section
  name_at = 1
  for name, offset, blob in zip([*sections, b".shstrtab"], offsets, blobs):
    headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, offset, len(blob), 0, 0, 8, 0))
    name_at += len(name) + 1
  data += b"".join(headers)
  data[:16] = b"\x7fELF\x02\x01\x01" + bytes(9)
  struct.pack_into("<Q", data, 0x28, shoff)
  struct.pack_into("<HHH", data, 0x3A, 64, len(headers), len(headers) - 1)
  return bytes(data)


def test_keeps_only_the_architecture_asked_for():
  runtime = _fatbin(_entry(80, b"A" * 40), _entry(90, b"B" * 24)) + bytes(8) + _fatbin(
      _entry(100, b"C" * 16), _entry(90, b"D" * 8))
  relocatable = _fatbin(_entry(120, b"E" * 32))
  library = _elf({b".text": b"host code", b".nv_fatbin": runtime,
                  b"__nv_relfatbin": relocatable + _fatbin(_entry(90, b"F" * 8))})
  slimmed, seen = slim_nccl.slim(library, 90)
  assert seen == {80: 40, 90: 40, 100: 16, 120: 32}
  assert len(slimmed) == len(library)
  for kept in (b"B" * 24, b"D" * 8, b"F" * 8, b"host code"):
    assert kept in slimmed
  for dropped in (b"A" * 40, b"C" * 16, b"E" * 32):
    assert dropped in library and dropped not in slimmed
  # Only payload bytes changed: every header is where it was.
  changed = [i for i, (a, b) in enumerate(zip(library, slimmed)) if a != b]
  assert len(changed) == 40 + 16 + 32
  assert slim_nccl.elf_sections(slimmed) == slim_nccl.elf_sections(library)


def test_refuses_what_it_cannot_read():
  with pytest.raises(ValueError, match="no device code for architecture 90"):
    slim_nccl.slim(_elf({b".nv_fatbin": _fatbin(_entry(80, b"A" * 8))}), 90)
  broken = bytearray(_fatbin(_entry(90, b"A" * 8)))
  struct.pack_into("<Q", broken, 8, 40)  # the blob claims fewer bytes than its entry holds
  with pytest.raises(ValueError, match="end at"):
    slim_nccl.slim(_elf({b".nv_fatbin": bytes(broken)}), 90)
  with pytest.raises(ValueError, match="ELF64"):
    slim_nccl.slim(b"MZ not an ELF file", 90)


def test_reads_a_real_elf_file():
  with open(sys.executable, "rb") as f:
    data = f.read()
  if data[:4] != b"\x7fELF":
    pytest.skip("the Python executable is not an ELF file here")
  sections = slim_nccl.elf_sections(data)
  assert b".text" in sections and all(o + s <= len(data) for o, s in sections.values()
                                      if o and s)


def test_build_writes_the_slimmed_library_compressed(tmp_path):
  library = _elf({b".nv_fatbin": _fatbin(_entry(80, b"A" * 4096), _entry(90, b"B" * 64))})
  source = tmp_path / "libnccl.so.2"
  source.write_bytes(library)
  out = tmp_path / "out" / "libnccl.so.2.xz"
  assert slim_nccl.main(["build", str(source), str(out)]) == 0
  assert lzma.decompress(out.read_bytes()) == slim_nccl.slim(library, 90)[0]
