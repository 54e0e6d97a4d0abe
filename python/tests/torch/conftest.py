"""GPU tests of transformer_engine_comm.torch, one pytest per rank under torchrun
(scripts/torch-gpu.sh). Every rank runs the same tests in the same order; checks that
matter across ranks are agreed on through :func:`check_all`, so a failure on one rank fails
the test on every rank (and no rank is left waiting in a collective).

At the end the ranks agree on the outcome: every rank's exit status is non-zero when any
rank failed, and each rank's last line says which ranks failed ("te_comm torch tests: ...").
scripts/torch-gpu.sh shows rank 0's output and sends the other ranks' to log files
(torchrun --redirects); TE_COMM_TORCH_LOG_DIR names that folder in the closing line.
"""

import os
import sys

import pytest

try:
    import torch
    import torch.distributed as dist
except ImportError:  # the test files skip themselves
    torch = None
    dist = None

RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
UNDER_TORCHRUN = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ

def skip_reason():
    """Why the GPU tests cannot run here (None when they can)."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not dist.is_available() or not dist.is_nccl_available():
        return "torch.distributed with NCCL is not available"
    if not UNDER_TORCHRUN:
        return "not launched by torchrun (run scripts/torch-gpu.sh)"
    if WORLD_SIZE < 2:
        return "needs at least 2 ranks"
    if torch.cuda.device_count() <= LOCAL_RANK:
        return f"local rank {LOCAL_RANK} has no GPU ({torch.cuda.device_count()} visible)"
    return None


_state = {"initialized": False}


def init_distributed():
    """Initialise the default NCCL group once (lazily: the communicator is created by the
    library's first use, which exercises the lazy-init path of get_context)."""
    if not _state["initialized"]:
        torch.cuda.set_device(LOCAL_RANK)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if not dist.is_initialized():
            dist.init_process_group("nccl")
        _state["initialized"] = True
    return dist.group.WORLD


@pytest.fixture(scope="session")
def world():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    return init_distributed()


@pytest.fixture(scope="session")
def subgroups(world):
    """(my tp-2 group of consecutive ranks, my tp-2 group of strided ranks), created
    collectively once; None on worlds that cannot hold them."""
    n = dist.get_world_size()
    if n < 4 or n % 2:
        return None
    cur = None
    for r in range(0, n, 2):
        g = dist.new_group([r, r + 1])
        if RANK in (r, r + 1):
            cur = g
    half = n // 2
    strided = None
    for r in range(half):
        g = dist.new_group([r, r + half])
        if RANK in (r, r + half):
            strided = g
    return cur, strided


def check_all(ok, msg="", group=None):
    """Agree on a check across the ranks of ``group`` (default world): every rank fails
    (with the failing ranks' messages) when any rank's ``ok`` is False."""
    pg = group if group is not None else dist.group.WORLD
    mine = (bool(ok), RANK, str(msg))
    out = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, mine, group=pg)
    bad = [f"rank {r}: {m}" for good, r, m in out if not good]
    assert not bad, "; ".join(bad)


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64 (inf when out has non-finite values)."""
    o = out.double()
    r = ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    den = r.norm().item()
    num = (o - r).norm().item()
    return num / den if den > 0 else num


class TestContext:
    """What the tests share (the ``tc`` fixture): rank, world size, device, checks."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.device = torch.device("cuda", LOCAL_RANK)

    check_all = staticmethod(check_all)
    rel_err = staticmethod(rel_err)

    def gen(self, shape, seed, lo=-1.0, hi=1.0):
        """float32 uniform [lo, hi) on the GPU, identical on every rank for one seed."""
        g = torch.Generator(device=self.device)
        g.manual_seed(int(seed))
        return torch.rand(shape, generator=g, device=self.device) * (hi - lo) + lo

    def skew(self, iteration, cycles=20_000_000):
        """Delay one rank's stream (a different rank each iteration): a call that does not
        really wait for its peers then reads stale data."""
        if self.rank == iteration % self.size:
            torch.cuda._sleep(cycles)


@pytest.fixture(scope="session")
def tc(world):
    return TestContext(world)


# ----------------------------------------------------------------------------- outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session, exitstatus):
    """Before pytest's summary: agree on the outcome across ranks (and fail every rank when
    any failed)."""
    msg = None
    active = torch is not None and _state["initialized"] and dist.is_initialized()
    if active:
        failed = int(session.testsfailed)
        if exitstatus not in (0, 5) and not failed:
            failed = 1  # an internal error or an interruption counts as a failure
        try:
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, (RANK, failed, int(exitstatus)))
        except Exception as e:  # a broken group: report what we know
            out = None
            msg = f"te_comm torch tests: could not gather the ranks' outcomes: {e}"
        if out is not None:
            bad = [(r, f, s) for r, f, s in out if f or s not in (0, 5)]
            if bad:
                where = ", ".join(f"rank {r}: {f} failed (exit {s})" for r, f, s in bad)
                logs = os.environ.get("TE_COMM_TORCH_LOG_DIR")
                msg = f"te_comm torch tests: FAILED on {where}" + (f" (logs of the other ranks: {logs})" if logs else "")
                if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
            else:
                msg = f"te_comm torch tests: all {len(out)} ranks passed"
    session.config._te_comm_closing = (active, msg)
    yield


def pytest_unconfigure(config):
    """After pytest's summary: the closing line, then the teardown (userbuffers, contexts,
    the process group). The line comes first: torchrun stops the other ranks as soon as a
    failed rank exits."""
    active, msg = getattr(config, "_te_comm_closing", (False, None))
    if msg:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(msg)
        else:
            print(msg)
        sys.stdout.flush()
    if active:
        try:
            from transformer_engine_comm.torch import destroy_contexts, destroy_userbuffers

            destroy_userbuffers()
            destroy_contexts()
            dist.barrier(device_ids=[LOCAL_RANK])
            dist.destroy_process_group()
        except Exception as e:
            print(f"rank {RANK}: teardown: {e}", file=sys.stderr)
