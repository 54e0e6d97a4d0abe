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
import shutil
import subprocess
import sysconfig

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

LIBRARY = "libtransformer_engine_comm.so"


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
        build_data["tag"] = f"py3-none-{platform}"
