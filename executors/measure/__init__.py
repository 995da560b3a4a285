"""Plans measured as they run: step time, peak memory per rank, and what else loaded the machine meanwhile.

* :mod:`~executors.measure.step_timing` — many saved plans timed in one torchrun job;
* :mod:`~executors.measure.measure_plan` — one plan as its training program runs it (``plan tune``'s job);
* :mod:`~executors.measure.memory_peak` — a rank's peak over one step, from the CPU allocator's counter;
* :mod:`~executors.measure.machine_load` — the CPU shares of the VM's host and of other processes.
"""
