"""The memory meter against allocations of known size."""

from __future__ import annotations

import sys

import pytest
import torch

from st_ext.memory import CPU_METER, CUDA_METER, measure_peak, replay_allocation_events

MIB = 2**20


def test_cpu_meter_sees_a_known_allocation():
    with measure_peak("cpu") as peak:
        block = torch.empty(8 * MIB, dtype=torch.uint8)
        del block
    assert peak.meter == CPU_METER
    assert 8 * MIB <= peak.peak_bytes < 8 * MIB + 64 * 1024


def test_cpu_meter_reports_the_peak_not_the_sum():
    with measure_peak("cpu") as peak:
        first = torch.empty(6 * MIB, dtype=torch.uint8)
        del first
        second = torch.empty(4 * MIB, dtype=torch.uint8)
        del second
    assert 6 * MIB <= peak.peak_bytes < 7 * MIB


def test_memory_held_before_entry_does_not_count():
    held = torch.empty(16 * MIB, dtype=torch.uint8)
    with measure_peak("cpu") as peak:
        del held
        small = torch.empty(MIB, dtype=torch.uint8)
        del small
    assert MIB <= peak.peak_bytes < 2 * MIB


def test_free_of_a_block_from_an_earlier_window_does_not_count():
    """The profiler reports that free (it saw the allocation); it must not make room for this block's own."""
    with measure_peak("cpu"):
        early = torch.empty(64 * 1024, dtype=torch.uint8)
    with measure_peak("cpu") as peak:
        del early
        small = torch.empty(MIB, dtype=torch.uint8)
        del small
    assert MIB <= peak.peak_bytes < MIB + 64 * 1024


def test_peak_replays_events_in_time_order():
    events = [(3, -4), (1, 10), (2, 4), (4, 1)]
    assert replay_allocation_events(events) == (14, 11)


def test_frees_without_an_allocation_in_the_window_are_ignored():
    assert replay_allocation_events([(1, -8), (2, 5), (3, -7), (4, 2), (5, -5)]) == (7, 2)


def test_cpu_meter_reports_what_the_block_leaves_alive():
    with measure_peak("cpu") as peak:
        kept = torch.empty(3 * MIB, dtype=torch.uint8)
        passing = torch.empty(5 * MIB, dtype=torch.uint8)
        del passing
    assert 3 * MIB <= peak.end_bytes < 3 * MIB + 64 * 1024
    assert 8 * MIB <= peak.peak_bytes < 8 * MIB + 64 * 1024
    del kept


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="cpu"):
        with measure_peak("meta"):
            pass


@pytest.mark.cuda
def test_cuda_meter_sees_a_known_allocation():
    with measure_peak("cuda") as peak:
        block = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        del block
    assert peak.meter == CUDA_METER
    assert 8 * MIB <= peak.peak_bytes < 8 * MIB + 2 * MIB
    assert peak.end_bytes == 0


@pytest.mark.cuda
def test_cuda_meter_reports_what_the_block_leaves_alive():
    with measure_peak("cuda") as peak:
        kept = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
    assert peak.end_bytes == 3 * MIB
    del kept


def test_the_cpu_meter_prints_nothing_of_its_own(capfd):
    """The profiler's native start/stop lines ("USDT ... profiler_start") stay off the console."""
    with measure_peak("cpu") as peak:
        torch.ones(4096).sum()
    print("after the window", file=sys.stderr)
    captured = capfd.readouterr()
    assert "profiler_st" not in captured.err + captured.out and "USDT" not in captured.err + captured.out
    assert "after the window" in captured.err, "the descriptor is restored"
    assert peak.peak_bytes >= 0


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_nested_measurements_each_read_their_own_window_and_the_outer_sees_the_inner(device):
    """A step measured around an auto mini-batch probe: the probe's peak counts toward the step's."""
    with measure_peak(device) as outer:
        before = torch.empty(2**20, dtype=torch.uint8, device=device)
        with measure_peak(device) as inner:
            inside = torch.empty(3 * 2**20, dtype=torch.uint8, device=device)
            del inside
        after = torch.empty(2 * 2**20, dtype=torch.uint8, device=device)
        del before, after
    assert 3 * 2**20 <= inner.peak_bytes < 3 * 2**20 + 2**16
    # 1 MiB held while the inner 3 MiB lived: 4 MiB, above the later 1 + 2 MiB.
    assert 4 * 2**20 <= outer.peak_bytes < 4 * 2**20 + 2**16
