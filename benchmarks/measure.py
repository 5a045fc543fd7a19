"""
What the step-count benchmarks (``conjugate.py``, ``full_covariance.py``,
``autoguide.py``) measure alike: steps until a criterion holds and keeps holding,
milliseconds per step with the methods interleaved, and where the table goes.
"""

import statistics
import time
from typing import Callable, Dict, Optional, Tuple

import pyro


def steps_until(step: Callable[[], None], converged: Callable[[], bool], max_steps: int,
                confirm: int) -> Optional[int]:
    """The first step after which ``converged()`` holds and keeps holding for ``confirm``
    more steps (``None`` if none by ``max_steps``)."""
    entry = None
    for count in range(1, max_steps + confirm + 1):
        step()
        if converged():
            if entry is None:
                if count > max_steps:
                    break
                entry = count
            elif count - entry >= confirm:
                return entry
        else:
            entry = None
    return None


def ms_per_step(make_svis: Dict[str, Callable], args: tuple, warmup: int, rounds: int,
                block: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Median wall-clock and CPU (``time.process_time``) ms per ``svi.step(*args)`` of each
    ``make_svis[name]()``, each in its own param-store scope, the methods interleaved in
    blocks of ``block`` steps for ``rounds`` rounds after ``warmup`` steps each."""
    store = pyro.get_param_store()
    states, svis = {}, {}
    wall, cpu = {name: [] for name in make_svis}, {name: [] for name in make_svis}
    pyro.set_rng_seed(0)
    for name, make in make_svis.items():
        with store.scope() as state:
            svis[name] = make()
            for _ in range(warmup):
                svis[name].step(*args)
        states[name] = state
    for _ in range(rounds):
        for name, svi in svis.items():
            with store.scope(states[name]):
                for _ in range(block):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    svi.step(*args)
                    cpu[name].append(time.process_time() - start_cpu)
                    wall[name].append(time.perf_counter() - start)
    return ({name: 1e3 * statistics.median(t) for name, t in wall.items()},
            {name: 1e3 * statistics.median(t) for name, t in cpu.items()})


def publish(text: str, started: float, out: Optional[str]) -> None:
    """Print the table and the run's total time; write the table to ``out`` if given."""
    print(text)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
