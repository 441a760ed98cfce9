"""`oxygen bench` (`python -m oxygen_ros.tools.bench`): isolated vs shared vs oxygen on one model and one seeded
input stream, back to back in one process. It builds the preset's model (random weights, seeded), synthetic frames
(random images, seeded state and noise) and a language arrival schedule (one request per frame by default; Poisson
arrivals and mixed lengths optional), measures the component costs (prefill, action sampling / denoise step, one
batched decode step per batch size), derives the ideal oxygen-over-isolated speedup they imply, runs each mode with
warm-up excluded, checks that the modes produced the same action chunks and the same tokens, and writes a table,
JSON (with the hardware named) and a PNG (action Hz vs tokens/s per mode, and the k/N sweep when run).
With ``--compile inductor|cudagraphs|inductor-graphs`` every measurement is taken twice in the same run, eager and
compiled, on the same model and inputs: component costs per step side by side, each mode eager and compiled
(interleaved frame by frame), the compile time per graph, and the dispatched operators per prefill / denoise / decode
step from the profiler (the
launch-overhead proxy: on a GPU also the CUDA kernels launched); ``--bf16-check`` reports the action difference bf16 vs
fp32 on the same inputs (tiny dims) so a GPU's tolerance is known before one is used.  Imports no ROS.

The package, one concern per module: ``inputs.py`` (seeded frames, noise, arrivals), ``costs.py`` (component costs
and the ideal speedup), ``runs.py`` (the engine runs per mode, the equivalence check, the k/N sweep),
``compiled.py`` (eager vs compiled: shared shapes, operator counts, bf16 check), ``report.py`` (hardware, table,
plot, JSON), ``command.py`` (the command line and the run that ties them together; ``main`` returns the exit status,
``run`` the results document).  This file only chooses OpenMP's wait policy, before anything imports torch.
"""
import os
import sys

# On a CPU shared with other processes, OpenMP's default spin-waiting makes every parallel region wait for
# descheduled threads (measured here: a 220 ms prefill took 4 s). Passive waiting must be chosen before torch loads
# libgomp; an explicit setting by the user wins. Recorded in the results (hardware.omp_wait_policy).
_OMP_PRESET = "OMP_WAIT_POLICY" in os.environ
_TORCH_PRELOADED = "torch" in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def omp_wait_policy() -> str:
    """The OMP_WAIT_POLICY of this process as the results record it (noting when it came too late to take effect)."""
    late = _TORCH_PRELOADED and not _OMP_PRESET
    return os.environ.get("OMP_WAIT_POLICY", "") + (" (set after torch was loaded: not in effect)" if late else "")
