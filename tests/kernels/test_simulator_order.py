"""The simulator children start longest first (cuda_sim.LONGEST_RUNS): a renamed or removed file there would
silently lose its place, so every listed name must be a test file with a simulator run."""

from __future__ import annotations

from tests.kernels.cuda_sim import LONGEST_RUNS, ROOT, longest_first


def test_longest_runs_name_simulator_test_files():
    files = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}
    for name in LONGEST_RUNS:
        assert name in files and "in_simulator" in files[name].read_text(), name


def test_listed_files_go_first_in_their_order_and_the_others_after_as_given():
    given = ["a/test_new.py", "b/test_cuda_tree.py", "c/test_other.py", "d/test_cuda_verify.py"]
    assert longest_first(given) == ["d/test_cuda_verify.py", "b/test_cuda_tree.py", "a/test_new.py",
                                    "c/test_other.py"]
