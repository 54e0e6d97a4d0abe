"""hatchling build hook (pyproject.toml): put libtransformer_engine_comm.so into the wheel.

Wheel: runs `cargo build --release` in the repository (the command scripts/test.sh and
CMake run, in the same target directory, so an existing build is reused rather than
redone), takes the cdylib cargo reports, adds it as
transformer_engine_comm/libtransformer_engine_comm.so and tags the wheel
py3-none-<platform>: the library does not use the Python C API, so one wheel serves every
Python 3 version. TE_COMM_WHEEL_LIB=<path> bundles that prebuilt library instead (no
cargo needed). Editable installs: the library is built in target/release, where the
package finds it when it runs from the source tree.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sysconfig

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

LIBRARY = "libtransformer_engine_comm.so"

# The libraries a manylinux wheel may link without bundling them (PEP 599 / PEP 600's
# policy list, the ones a Rust cdylib can need).
MANYLINUX_LIBS = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "librt.so.1", "libpthread.so.0",
    "libgcc_s.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
}


def elf_dynamic_needs(path: str):
    """(DT_NEEDED libraries, GLIBC symbol versions the file requires) of a 64-bit
    little-endian ELF shared library, read from its .dynamic and .gnu.version_r sections."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise RuntimeError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, _info, _align, _entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append((name, typ, off, size, link))

    def cstr(off: int) -> str:
        return data[off:data.index(b"\0", off)].decode()

    needed, versions = [], set()
    for _name, typ, off, size, link in sections:
        strtab = sections[link][2]
        if typ == 6:  # SHT_DYNAMIC: (tag, value) pairs; DT_NEEDED = 1
            for j in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, off + j)
                if tag == 0:
                    break
                if tag == 1:
                    needed.append(cstr(strtab + val))
        elif typ == 0x6FFFFFFE:  # SHT_GNU_verneed: Verneed entries, each with Vernaux entries
            pos = off
            while True:
                _ver, cnt, _file, aux, nxt = struct.unpack_from("<HHIII", data, pos)
                apos = pos + aux
                for _ in range(cnt):
                    _hash, _fl, _other, vname, anext = struct.unpack_from("<IHHII", data, apos)
                    versions.add(cstr(strtab + vname))
                    apos += anext
                if nxt == 0:
                    break
                pos += nxt
    return needed, versions


def manylinux_platform(lib: str, machine: str) -> str:
    """The manylinux tag the library honestly carries: glibc >= the highest GLIBC_x.y
    symbol version it requires, and nothing linked outside the manylinux policy's list."""
    needed, versions = elf_dynamic_needs(lib)
    outside = sorted(set(needed) - MANYLINUX_LIBS)
    if outside:
        raise RuntimeError(f"{lib} links {outside}, outside the manylinux policy: no manylinux tag")
    glibc = [tuple(int(p) for p in m.group(1).split(".")) for v in versions
             if (m := re.fullmatch(r"GLIBC_([0-9]+(?:\.[0-9]+)*)", v))]
    major, minor = max(glibc, default=(2, 17))[:2]
    return f"manylinux_{major}_{max(minor, 17) if major == 2 else minor}_{machine}"


def _cargo_build(root: str) -> str:
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        raise RuntimeError(
            "building the transformer_engine_comm wheel needs cargo (https://rustup.rs), "
            "or TE_COMM_WHEEL_LIB=<path to a prebuilt libtransformer_engine_comm.so>"
        )
    cmd = [cargo, "build", "--release", "--message-format=json-render-diagnostics"]
    proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); its diagnostics are above")
    found = []
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and "cdylib" in msg.get("target", {}).get("kind", []):
            found += [f for f in msg.get("filenames", []) if os.path.basename(f) == LIBRARY]
    if not found:
        raise RuntimeError(f"cargo built no {LIBRARY}")
    return found[-1]


class CustomBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        prebuilt = os.environ.get("TE_COMM_WHEEL_LIB")
        if version == "editable":
            if not prebuilt:
                _cargo_build(self.root)
            return
        if prebuilt:
            if not os.path.isfile(prebuilt):
                raise RuntimeError(f"TE_COMM_WHEEL_LIB={prebuilt}: no such file")
            lib = prebuilt
        else:
            lib = _cargo_build(self.root)
        build_data["force_include"][lib] = f"transformer_engine_comm/{LIBRARY}"
        build_data["pure_python"] = False
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        if platform.startswith("linux_"):
            # Package indexes refuse linux_* wheels; the library links only libc and
            # libgcc_s, so a manylinux tag (glibc from its symbol versions) is honest.
            platform = manylinux_platform(lib, platform[len("linux_"):])
        build_data["tag"] = f"py3-none-{platform}"
