"""`failure_ends_other_ranks`: a step failing on a rank other than the first ends that rank's process (vLLM
reports only the output rank's exceptions), while the first rank's exceptions propagate. The real engine's case is
in `tests/test_wcs_tp.py`."""

import subprocess
import sys
import textwrap

import pytest

from replicas.wcs.sharing import RANK_FAILURE_EXIT_CODE, failure_ends_other_ranks

SCRIPT = textwrap.dedent(
    """
    import sys
    from replicas.wcs.sharing import failure_ends_other_ranks

    def step():
        raise ValueError("planted")

    failure_ends_other_ranks(step, rank=lambda: int(sys.argv[1]))()
    print("went on", flush=True)
    """
)


def _run(rank: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(rank)], capture_output=True, text=True, timeout=120)


def test_a_failed_step_on_rank_one_ends_its_process_with_the_error_logged():
    proc = _run(1)
    assert proc.returncode == RANK_FAILURE_EXIT_CODE and "went on" not in proc.stdout
    assert "tensor-parallel rank 1" in proc.stderr and "ValueError: planted" in proc.stderr


def test_a_failed_step_on_rank_zero_raises_as_before():
    proc = _run(0)
    assert proc.returncode == 1 and "ValueError: planted" in proc.stderr and "ending this worker" not in proc.stderr


def test_a_step_that_succeeds_returns_its_value_on_any_rank():
    assert failure_ends_other_ranks(lambda x: x + 1, rank=lambda: 1)(41) == 42
    with pytest.raises(KeyError):
        failure_ends_other_ranks(lambda: {}["k"], rank=lambda: 0)()
