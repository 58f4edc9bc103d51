"""A newer NCCL, slimmed to one GPU architecture, to carry to the GPU machines.

    python -m benchmarks.slim_nccl build nvidia_nccl_cu13-2.32.3-...whl .nccl/libnccl.so.2.xz
    python -m benchmarks.slim_nccl install .nccl/libnccl.so.2.xz   # on the GPU machine
    python -m benchmarks.slim_nccl restore                         # put the original back

The fused kernels need NCCL >= 2.29.2 in a multi-process job
(`pallas_kernels.platform.peer_access_reason`); jaxlib 0.11.2's wheels bring
2.28.9 and the GPU machines cannot fetch packages. The `nvidia-nccl-cu13`
wheel is ~300 MB, over what a device call carries (64 MiB), almost all of it
device code for every GPU architecture. `build` zeroes the payload of every
fatbin entry (in `.nv_fatbin` and `__nv_relfatbin`) whose architecture is not
`--arch` (90: Hopper), keeping every header so that the CUDA driver still
walks the fatbins and picks the sm_90 entries, and writes the library
xz-compressed (2.32.3: 344 MB -> 44 MB). `install` puts it in place of the
`nvidia-nccl-*` wheel's library, which the CUDA plugin loads (the original is
kept beside it as `libnccl.so.2.orig`); `restore` undoes that.
"""

import argparse
import lzma
import os
import pathlib
import shutil
import struct
import sys
import zipfile

FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTIONS = (b".nv_fatbin", b"__nv_relfatbin")
LIBRARY = "libnccl.so.2"


def elf_sections(data: bytes) -> dict[bytes, tuple[int, int]]:
  """{section name: (file offset, size)} of a little-endian ELF64 file."""
  if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
    raise ValueError("not a little-endian ELF64 file")
  shoff, = struct.unpack_from("<Q", data, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
  headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
  names_at = headers[shstrndx][4]
  sections = {}
  for name_off, _, _, _, offset, size, *_ in headers:
    name = data[names_at + name_off:data.index(b"\0", names_at + name_off)]
    sections[name] = (offset, size)
  return sections


def zero_other_archs(data: bytearray, offset: int, size: int, keep: int) -> dict[int, int]:
  """Zeroes, in place, the payload of every fatbin entry in data[offset:
  offset + size] whose architecture is not `keep`; returns {arch: payload
  bytes} of all entries seen.

  A fatbin: a 16-byte header (magic, version, header size, entries' size),
  then entries, each a header (kind, version, header size, payload size, ...,
  architecture at byte 28) and its payload. Blobs follow one another, padded.

  Raises:
    ValueError: an entry runs past its blob (not a fatbin layout this reads).
  """
  seen: dict[int, int] = {}
  pos, end = offset, offset + size
  while pos + 16 <= end:
    magic, _, header, entries = struct.unpack_from("<IHHQ", data, pos)
    if magic != FATBIN_MAGIC:
      pos += 8  # padding between blobs
      continue
    at, stop = pos + header, pos + header + entries
    while at < stop:
      _, _, entry_header, payload = struct.unpack_from("<HHIQ", data, at)
      arch, = struct.unpack_from("<I", data, at + 28)
      seen[arch] = seen.get(arch, 0) + payload
      if arch != keep:
        data[at + entry_header:at + entry_header + payload] = bytes(payload)
      at += entry_header + payload
    if at != stop:
      raise ValueError(f"fatbin entries at {pos:#x} end at {at:#x}, not {stop:#x}")
    pos = stop
  return seen


def slim(library: bytes, keep: int) -> tuple[bytes, dict[int, int]]:
  """The library with other architectures' device code zeroed, and what it held."""
  data = bytearray(library)
  sections = elf_sections(bytes(data))
  seen: dict[int, int] = {}
  for name in FATBIN_SECTIONS:
    if name in sections:
      for arch, n in zero_other_archs(data, *sections[name], keep).items():
        seen[arch] = seen.get(arch, 0) + n
  if keep not in seen:
    raise ValueError(f"no device code for architecture {keep}; found {sorted(seen)}")
  return bytes(data), seen


def _read_library(source: str) -> bytes:
  if source.endswith(".whl"):
    with zipfile.ZipFile(source) as wheel:
      name = next(n for n in wheel.namelist() if n.endswith("/" + LIBRARY))
      return wheel.read(name)
  return pathlib.Path(source).read_bytes()


def _installed_library() -> pathlib.Path:
  import nvidia.nccl  # pylint: disable=import-outside-toplevel
  for directory in nvidia.nccl.__path__:
    path = pathlib.Path(directory) / "lib" / LIBRARY
    if path.exists():
      return path
  raise FileNotFoundError(f"no {LIBRARY} in the nvidia-nccl wheel's package")


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  build = sub.add_parser("build", help="slim a wheel's (or a file's) libnccl.so.2 to one arch")
  build.add_argument("source", help="an nvidia-nccl-* wheel or a libnccl.so.2")
  build.add_argument("out", help="the slimmed library, xz-compressed")
  build.add_argument("--arch", type=int, default=90, help="architecture to keep (90: Hopper)")
  install = sub.add_parser("install", help="replace the wheel's library with a built one")
  install.add_argument("built", help="the output of `build`")
  sub.add_parser("restore", help="put the wheel's original library back")
  args = parser.parse_args(argv)
  if args.command == "build":
    data, seen = slim(_read_library(args.source), args.arch)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(args.out, "wb", preset=6) as out:
      out.write(data)
    kept = seen[args.arch] / 1e6
    print(f"{args.out}: {os.path.getsize(args.out) / 1e6:.1f} MB (device code by arch, MB:"
          f" {', '.join(f'{a}: {n / 1e6:.1f}' for a, n in sorted(seen.items()))}; kept {kept:.1f})")
    return 0
  target = _installed_library()
  backup = target.with_name(LIBRARY + ".orig")
  if args.command == "install":
    if not backup.exists():
      shutil.copy2(target, backup)
    with lzma.open(args.built) as built, open(target, "wb") as out:
      shutil.copyfileobj(built, out)
    print(f"{target}: replaced by {args.built} (original: {backup})")
  else:
    if backup.exists():
      shutil.move(backup, target)
    print(f"{target}: the original")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
