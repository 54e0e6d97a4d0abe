"""Shared setup of the binding tests: the package is imported from this source tree
(python/), and the library is the one TE_COMM_LIB names, else <repo>/target/release."""
import importlib.util
import os
import sys

import pytest

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PYTHON_DIR)
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

# pytest puts python/tests on sys.path, where the folders torch/ and jax/ (the GPU tests)
# would import as namespace packages named "torch" and "jax" when those are not installed:
# pytest.importorskip("torch") would then succeed and the tests fail on a missing
# torch.distributed instead of skipping. Mark a framework that is only such a folder as
# absent (an import of it raises ImportError).
for _name in ("torch", "jax"):
    if _name not in sys.modules:
        _spec = importlib.util.find_spec(_name)
        if _spec is not None and _spec.origin is None:  # a namespace package: one of our folders
            sys.modules[_name] = None


@pytest.fixture(scope="session")
def capi():
    """transformer_engine_comm._capi with the library loaded. A library that cannot be
    loaded fails the tests (it is what they test), it does not skip them."""
    from transformer_engine_comm import _capi

    try:
        _capi.lib()
    except _capi.CommError as e:
        pytest.fail(f"the library cannot be loaded: {e}")
    return _capi


@pytest.fixture(scope="session")
def header_text():
    with open(os.path.join(REPO, "include", "transformer_engine_comm.h"), encoding="utf-8") as f:
        return f.read()
