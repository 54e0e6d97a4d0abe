"""Shared setup of the binding tests: the package is imported from this source tree
(python/), and the library is the one TE_COMM_LIB names, else <repo>/target/release."""
import os
import sys

import pytest

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(PYTHON_DIR)
if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)


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
