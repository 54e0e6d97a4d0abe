"""Build and load the example extension (te_comm_ext.cpp) with torch.utils.cpp_extension.load.

The installed library is found with pkg-config (`pkg-config --cflags --libs
transformer_engine_comm`, so PKG_CONFIG_PATH must name <prefix>/lib/pkgconfig); when the
pkg-config program is missing, the transformer_engine_comm.pc file is read directly from
the PKG_CONFIG_PATH folders. The extension gets an rpath to the library's folder, so no
LD_LIBRARY_PATH is needed.

    python build_ext.py            # build (or check it is up to date) and print the module path
    from build_ext import load_extension; ext = load_extension()

Environment: TORCH_EXTENSIONS_DIR (where torch builds it; default ~/.cache/torch_extensions),
CUDA_HOME (CUDA headers; default /usr/local/cuda or nvcc's), MAX_JOBS.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = "transformer_engine_comm"
EXT_NAME = "te_comm_torch_ext"


def _parse_pc(path):
    """Minimal .pc reader: variables (name=value, ${var} substitution; ${pcfiledir} is the
    file's folder, as in pkg-config) and Cflags / Libs."""
    variables, fields = {"pcfiledir": os.path.dirname(os.path.abspath(path))}, {}

    def subst(v):
        return re.sub(r"\$\{(\w+)\}", lambda m: variables.get(m.group(1), ""), v)

    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.match(r"^([A-Za-z0-9_.]+)\s*([=:])\s*(.*)$", line)
            if not m:
                continue
            key, sep, value = m.groups()
            if sep == "=":
                variables[key] = subst(value)
            else:
                fields[key] = subst(value)
    return variables, fields


def find_library():
    """-> (cflags list, libs list, libdir) of the installed transformer_engine_comm."""
    pkg_config = shutil.which("pkg-config")
    if pkg_config:
        try:
            cflags = subprocess.check_output([pkg_config, "--cflags", PKG], text=True)
            libs = subprocess.check_output([pkg_config, "--libs", PKG], text=True)
            libdir = subprocess.check_output([pkg_config, "--variable=libdir", PKG], text=True).strip()
            return shlex.split(cflags), shlex.split(libs), libdir
        except subprocess.CalledProcessError as e:
            raise RuntimeError(
                f"pkg-config could not find {PKG} (PKG_CONFIG_PATH={os.environ.get('PKG_CONFIG_PATH', '')!r}): "
                f"install the library with CMake (cmake --install) and add <prefix>/lib/pkgconfig to "
                f"PKG_CONFIG_PATH") from e
    for d in filter(None, os.environ.get("PKG_CONFIG_PATH", "").split(os.pathsep)):
        pc = os.path.join(d, PKG + ".pc")
        if os.path.isfile(pc):
            variables, fields = _parse_pc(pc)
            return shlex.split(fields.get("Cflags", "")), shlex.split(fields.get("Libs", "")), variables.get("libdir", "")
    raise RuntimeError(f"no pkg-config program and no {PKG}.pc in PKG_CONFIG_PATH="
                       f"{os.environ.get('PKG_CONFIG_PATH', '')!r}")


def load_extension(verbose=False):
    """Build (if needed) and import the extension; returns the module."""
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH") and not shutil.which("nvcc") \
            and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    # Only C++ sources, but with_cuda=True makes torch compute nvcc arch flags, which fails
    # on a machine without a visible GPU unless an arch list is given (unused otherwise).
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    import torch  # noqa: F401  (torch first: its NCCL is the one the library binds)
    from torch.utils import cpp_extension

    cflags, libs, libdir = find_library()
    include_dirs = [f[2:] for f in cflags if f.startswith("-I")]
    other_cflags = [f for f in cflags if not f.startswith("-I")]
    ldflags = list(libs)
    if libdir:
        ldflags.append(f"-Wl,-rpath,{os.path.normpath(libdir)}")
    return cpp_extension.load(
        name=EXT_NAME,
        sources=[os.path.join(HERE, "te_comm_ext.cpp")],
        extra_include_paths=include_dirs,
        extra_cflags=["-O2"] + other_cflags,
        extra_ldflags=ldflags,
        with_cuda=True,
        verbose=verbose,
    )


if __name__ == "__main__":
    ext = load_extension(verbose="-v" in sys.argv)
    print(f"built {ext.__file__} (library version {ext.version()})")
