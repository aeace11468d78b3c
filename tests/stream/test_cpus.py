"""Worker and thread counts from the CPUs this process may use (affinity, cgroup v2/v1 quota), never more busy
threads (decoding workers + torch's threads) than those CPUs by default; a count the user chose is kept."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import featurehooks as fh
from featurehooks._stream import cpus, loader
from featurehooks._stream import forward as stream_forward


@pytest.fixture
def cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cgroup folder in place of /sys/fs/cgroup, and an affinity of 8 CPUs."""
    monkeypatch.setattr(cpus, "_CGROUP", tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    return tmp_path


def test_the_affinity_counts_not_the_machine(cgroup: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert cpus.available_cpus() == 8
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # not on Linux: the machine's count
    assert cpus.available_cpus() == 64


@pytest.mark.parametrize(("text", "expected"), [("150000 100000\n", 2), ("max 100000\n", 8), ("50000 100000", 1)])
def test_a_cgroup_v2_quota_caps_the_cpus(cgroup: Path, text: str, expected: int) -> None:
    (cgroup / "cpu.max").write_text(text)
    assert cpus.available_cpus() == expected


@pytest.mark.parametrize(
    ("folder", "quota", "expected"), [("cpu", 300000, 3), ("cpu,cpuacct", 200000, 2), ("cpu", -1, 8)]
)
def test_a_cgroup_v1_quota_caps_the_cpus(cgroup: Path, folder: str, quota: int, expected: int) -> None:
    (cgroup / folder).mkdir()
    (cgroup / folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (cgroup / folder / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.available_cpus() == expected


@pytest.mark.parametrize(("cores", "on_cpu", "on_gpu"), [(1, 0, 0), (2, 0, 1), (4, 1, 3), (8, 2, 4), (64, 4, 4)])
def test_default_workers_leave_the_cores_to_the_forward(
    monkeypatch: pytest.MonkeyPatch, cores: int, on_cpu: int, on_gpu: int
) -> None:
    monkeypatch.setattr(loader, "available_cpus", lambda: cores)
    assert loader.loader_workers(None, 100) == on_cpu
    assert loader.loader_workers(None, 100, cpu_forward=False) == on_gpu
    assert loader.loader_workers(3, 100) == min(3, 4 * cores)  # asked for: kept, within 4 a core


@pytest.fixture
def torch_default(monkeypatch: pytest.MonkeyPatch) -> int:
    """torch's thread count as if nobody had chosen one (no variable, no set_num_threads since import)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpus, "_DEFAULT_THREADS", torch.get_num_threads())
    return torch.get_num_threads()


def test_threads_take_the_cores_the_workers_leave(monkeypatch: pytest.MonkeyPatch, torch_default: int) -> None:
    monkeypatch.setattr(cpus, "available_cpus", lambda: 2)
    assert cpus.threads_for(1) == 1
    assert cpus.threads_for(5) == 1
    assert cpus.threads_for(0) == min(torch_default, 2)
    monkeypatch.setattr(cpus, "available_cpus", lambda: 1000)
    assert cpus.threads_for(0) == torch_default  # never more than torch's own choice


def test_a_thread_count_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch, torch_default: int) -> None:
    monkeypatch.setattr(cpus, "available_cpus", lambda: 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpus.threads_for(0) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(cpus, "_DEFAULT_THREADS", torch_default + 1)  # set_num_threads since featurehooks' import
    assert cpus.threads_for(0) is None


def test_the_thread_count_is_restored_after_the_block() -> None:
    before = torch.get_num_threads()
    with pytest.raises(KeyError), cpus.forward_threads(1):
        assert torch.get_num_threads() == 1
        raise KeyError
    assert torch.get_num_threads() == before


def test_statistics_on_a_busy_cpu_run_within_its_cores(monkeypatch: pytest.MonkeyPatch, torch_default: int) -> None:
    """A process allowed 2 CPUs on a machine of many: one default worker at most, and torch's threads within the
    cores left (never torch's count for the whole machine); the caller's count is back afterwards."""
    monkeypatch.setattr(cpus, "available_cpus", lambda: 2)
    monkeypatch.setattr(loader, "available_cpus", lambda: 2)
    monkeypatch.setattr(cpus, "_DEFAULT_THREADS", 16)
    torch.set_num_threads(16)
    seen: list[int] = []
    part = stream_forward._part_as_arrays

    def counted(*args: object) -> object:
        seen.append(torch.get_num_threads())
        return part(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(stream_forward, "_part_as_arrays", counted)
    try:
        torch.manual_seed(0)
        extractor = fh.FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        fh.feature_statistics(extractor, torch.rand(4, 3, 16, 16), pool="avg", batch_size=2)
        assert seen and set(seen) == {2}  # no worker on 2 cores: both to torch, not 16
        assert torch.get_num_threads() == 16
    finally:
        torch.set_num_threads(torch_default)


def test_the_wait_for_a_cpu_is_read_from_schedstat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for task, text in [("1", "500 2000000000 3\n"), ("2", "7 500000000 1\n"), ("3", "garbled\n")]:
        (tmp_path / task).mkdir()
        (tmp_path / task / "schedstat").write_text(text)
    monkeypatch.setattr(cpus, "_TASKS", tmp_path)
    assert cpus.cpu_wait_seconds() == 2.5
    monkeypatch.setattr(cpus, "_TASKS", tmp_path / "missing")  # no schedstat: nothing to say
    assert cpus.cpu_wait_seconds() is None
    assert not cpus.WaitMeter().contended(2)


def test_a_meter_calls_threads_that_waited_a_tenth_of_their_time_contended(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 101.0])  # one second of wall time
    monkeypatch.setattr(cpus.time, "perf_counter", lambda: next(clock))
    waits = iter([3.0, 3.25])
    monkeypatch.setattr(cpus, "cpu_wait_seconds", lambda: next(waits))
    assert cpus.WaitMeter().contended(2)  # 0.25 s of 2 threads x 1 s: over a tenth
    clock, waits = iter([100.0, 101.0]), iter([3.0, 3.15])
    assert not cpus.WaitMeter().contended(2)


def test_on_busy_cores_the_rest_of_a_batch_runs_in_one_forward(
    monkeypatch: pytest.MonkeyPatch, micro_batch_sizes: list[int]
) -> None:
    """Each micro-batch's many short OpenMP regions wait for a descheduled thread beside other jobs: after one
    that waited, the rest of the batch runs at once, with the same rows."""
    monkeypatch.setattr(stream_forward, "micro_batch_size", lambda *_: 2)
    torch.manual_seed(0)
    extractor = fh.FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), ["1"])
    images = torch.rand(9, 3, 16, 16)
    with cpus.forward_threads(2):
        monkeypatch.setattr(cpus.WaitMeter, "contended", lambda self, threads: False)  # whatever else runs now
        quiet = stream_forward.features_as_arrays(extractor, images, None, "float32", budget=1)
        assert micro_batch_sizes == [2, 2, 2, 3]
        micro_batch_sizes.clear()
        monkeypatch.setattr(cpus.WaitMeter, "contended", lambda self, threads: True)
        busy = stream_forward.features_as_arrays(extractor, images, None, "float32", budget=1)
    assert micro_batch_sizes == [2, 7]
    np.testing.assert_array_equal(busy["1"], quiet["1"])


def test_a_stream_that_saw_busy_cores_runs_its_next_batches_in_one_forward_until_they_are_quiet(
    monkeypatch: pytest.MonkeyPatch, micro_batch_sizes: list[int]
) -> None:
    """A first micro-batch at every batch waits as long as a whole batch beside other jobs: the stream remembers
    what it saw, meters the one forward of the next batch, and cuts batches again once one ran uncontended."""
    monkeypatch.setattr(stream_forward, "micro_batch_size", lambda *_: 2)
    torch.manual_seed(0)
    extractor = fh.FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), ["1"])
    images = torch.rand(9, 3, 16, 16)
    seen = [True, True, False]  # what the wait meter reports, forward after forward; quiet after those
    monkeypatch.setattr(cpus.WaitMeter, "contended", lambda self, threads: seen.pop(0) if seen else False)
    contention = cpus.Contention()
    rows = []
    with cpus.forward_threads(2):
        for _ in range(3):
            arrays = stream_forward.features_as_arrays(
                extractor, images, None, "float32", budget=1, contention=contention
            )
            rows.append(arrays["1"])
    assert micro_batch_sizes == [2, 7, 9, 2, 2, 2, 3]
    assert not seen and contention.busy is False
    for other in rows[1:]:
        np.testing.assert_array_equal(other, rows[0])


def test_a_stream_starts_from_what_the_last_stream_of_the_process_saw(
    monkeypatch: pytest.MonkeyPatch, micro_batch_sizes: list[int]
) -> None:
    """The second set of an FID, or the next dump of a loop, does not pay again for a micro-batch that waits."""
    monkeypatch.setattr(stream_forward, "micro_batch_size", lambda *_: 2)
    monkeypatch.setattr(cpus.WaitMeter, "contended", lambda self, threads: True)
    extractor = fh.FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), ["1"])
    with cpus.forward_threads(2):
        for _ in range(2):
            fh.feature_statistics(extractor, torch.rand(6, 3, 16, 16), pool="avg", batch_size=6, num_workers=0)
    assert micro_batch_sizes == [2, 4, 6] and cpus.LAST_SEEN.busy
