"""One NCCL per process: the library binds the NCCL copy already mapped in the process
(torch's or jax's wheel copy) before the search path, NVTE_COMM_NCCL_LIBRARY overrides,
and library_info() says which file is bound. Runs without a GPU (ncclGetVersion and
ncclGetUniqueId need none); each case runs in a fresh interpreter because the binding
holds for the life of a process."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = textwrap.dedent(
    """
    import ctypes, json, os, sys
    preload = os.environ.get("PROBE_PRELOAD")
    if preload:
        ctypes.CDLL(preload)          # what `import torch` does with its wheel's NCCL
    from transformer_engine_comm import _capi
    info = _capi.library_info()["nccl"]
    uid = _capi.nccl_get_unique_id()
    print(json.dumps({"path": info["path"], "version": info["version"],
                      "preloaded": info["preloaded"], "uid_len": len(uid),
                      "uid_nonzero": any(uid)}))
    """
)


def probe(**env):
    e = dict(os.environ)
    e["PYTHONPATH"] = PYTHON_DIR + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("NVTE_COMM_NCCL_LIBRARY", None)
    e.update(env)
    r = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def search_path_nccl():
    """The NCCL the library binds from the search path, asked in a fresh interpreter: this
    test process may already hold another copy (other test files import torch, which maps
    its wheel's NCCL), and the library would bind that one here."""
    code = textwrap.dedent(
        """
        import json
        from transformer_engine_comm import _capi
        try:
            print(json.dumps(_capi.library_info()["nccl"]))
        except _capi.CommError as e:
            print(json.dumps({"error": str(e)}))
        """
    )
    e = dict(os.environ)
    e["PYTHONPATH"] = PYTHON_DIR + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("NVTE_COMM_NCCL_LIBRARY", None)
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if "error" in info:
        pytest.skip(f"no NCCL on the library search path: {info['error']}")
    return info


def test_search_path_copy_when_none_is_mapped(search_path_nccl):
    r = probe()
    assert r["path"] == search_path_nccl["path"]
    assert os.path.basename(r["path"]).startswith("libnccl.so")
    assert r["preloaded"] is False
    assert r["version"] >= 21800, r          # NCCL 2.18 or newer (version code 2xxyy)
    assert r["uid_len"] == 128 and r["uid_nonzero"]


def test_the_copy_already_in_the_process_is_bound(search_path_nccl, tmp_path):
    # A second, distinct copy of NCCL outside the search path, mapped before the library
    # binds: like torch's site-packages/nvidia/nccl/lib/libnccl.so.2 beside a system copy.
    copy = tmp_path / "libnccl.so.2"
    shutil.copyfile(search_path_nccl["path"], copy)
    r = probe(PROBE_PRELOAD=str(copy))
    assert r["path"] == str(copy), r
    assert r["preloaded"] is True
    assert r["version"] == search_path_nccl["version"]
    assert r["uid_len"] == 128 and r["uid_nonzero"]


def test_environment_override_wins(search_path_nccl, tmp_path):
    copy = tmp_path / "libnccl.so.2"
    shutil.copyfile(search_path_nccl["path"], copy)
    r = probe(NVTE_COMM_NCCL_LIBRARY=str(copy))
    assert r["path"] == str(copy), r
    assert r["preloaded"] is False


def test_a_bad_override_is_reported_naming_the_variable(tmp_path):
    e = dict(os.environ)
    e["PYTHONPATH"] = PYTHON_DIR + os.pathsep + e.get("PYTHONPATH", "")
    e["NVTE_COMM_NCCL_LIBRARY"] = str(tmp_path / "missing.so")
    code = (
        "from transformer_engine_comm import _capi\n"
        "try:\n    _capi.library_info()['nccl']\n"
        "except _capi.CommError as err:\n    print(err.status_name, '|', err.message)\n"
        "else:\n    print('no error')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out.startswith("NVTE_COMM_ERROR_LIBRARY_NOT_FOUND"), out
    assert "NVTE_COMM_NCCL_LIBRARY" in out and "missing.so" in out, out
