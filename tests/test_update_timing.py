"""update_timing: an update's seconds split by who spent them, and the slow one named."""
import gc
import threading

import torch

from artsg_nb.rl.update_timing import SlowUpdates, UpdateTimer, UpdateTiming


def _spin(seconds: float) -> None:
    import time
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_timer_counts_gc_pauses_and_this_threads_cpu():
    with UpdateTimer(torch.device("cpu")) as timer:
        _spin(0.05)
        gc.collect()
    t = timer.timing
    assert t.gpu_s is None
    assert t.gc_collections >= 1 and t.gc_oldest == 2 and t.gc_s > 0
    assert t.thread_cpu_s >= 0.05 and t.wall_s >= t.thread_cpu_s * 0.9


def test_timer_names_another_busy_thread():
    spun, done = threading.Event(), threading.Event()

    def neighbour():
        _spin(0.2)
        spun.set()
        done.wait()  # alive when the update ends: its CPU time is read then

    worker = threading.Thread(target=neighbour, name="busy-neighbour")
    with UpdateTimer(torch.device("cpu")) as timer:
        worker.start()
        spun.wait()
    done.set()
    worker.join()
    assert timer.timing.other_threads_cpu_s.get("busy-neighbour", 0) >= 0.15
    assert "busy-neighbour" in timer.timing.why()


def test_checkpoint_wait_is_its_own_part():
    released = threading.Event()
    threading.Timer(0.05, released.set).start()
    with UpdateTimer(torch.device("cpu")) as timer:
        with timer.checkpoint_wait():
            released.wait()
    assert timer.timing.checkpoint_wait_s >= 0.04
    assert "checkpoint writer" in timer.timing.why()


def test_verdicts():
    assert "GIL" in UpdateTiming(wall_s=2.0, thread_cpu_s=0.05, gpu_s=0.03).why()
    assert "GPU was the limit" in UpdateTiming(wall_s=2.0, thread_cpu_s=0.05, gpu_s=1.9).why()
    assert "garbage collector" in UpdateTiming(wall_s=2.0, thread_cpu_s=1.9, gc_s=1.5, gc_collections=1,
                                               gc_oldest=2).why()
    assert "compiling" in UpdateTiming(wall_s=2.0, thread_cpu_s=1.0, compiled_kernels=2).why()


def test_slow_updates_need_a_median_and_a_real_excess():
    slow = SlowUpdates()
    fast = UpdateTiming(wall_s=0.03, thread_cpu_s=0.03)
    assert slow.slow(UpdateTiming(wall_s=2.0, thread_cpu_s=0.1)) is None  # the first pays one-off costs
    assert slow.slow(fast) is None and slow.slow(fast) is None
    assert slow.slow(UpdateTiming(wall_s=0.2, thread_cpu_s=0.1)) is None  # 6x, but under SLOW_MIN_S
    assert slow.slow(UpdateTiming(wall_s=1.5, thread_cpu_s=0.1)) > 3


def test_a_long_update_names_the_code_it_was_in(monkeypatch):
    from artsg_nb.rl import update_timing
    monkeypatch.setattr(update_timing, "SAMPLE_AFTER_S", 0.0)
    with UpdateTimer(torch.device("cpu")) as timer:
        _spin(0.3)
    assert any("_spin" in where for where in timer.timing.stacks), timer.timing.stacks
    assert "most sampled" in timer.timing.why()


def test_a_short_update_is_not_sampled():
    with UpdateTimer(torch.device("cpu")) as timer:
        pass
    assert timer.timing.stacks == {}


def test_cpu_on_the_forwards_and_the_backwards_threads_is_not_called_the_gpu():
    """The H100 smoke's 2.2 s updates: the GPU events spanned them, but the time was CPU on the
    update's thread then the autograd engine's (cuDNN attention plans)."""
    t = UpdateTiming(wall_s=2.246, thread_cpu_s=1.02, gpu_s=2.246, other_threads_cpu_s={"thread 1515": 1.22})
    assert "CPU work on the update's threads" in t.why() and "GPU was the limit" not in t.why()
