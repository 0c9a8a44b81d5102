"""GPU-shaped results for testing the notebooks and the paper before a GPU has run anything.

Nothing here is a measurement. Each module writes, into a scratch results folder, rows shaped
like those its experiment writes on an H100: the same experiment, provider, mode, metric, unit
and status vocabulary, the configurations taken from the experiment's own plan (so the fixture
follows the script when the script changes), out-of-memory, unsupported and unmeasured rows
where a GPU run has them, and made-up values of a plausible size. Tests run the notebooks on
them (device class h100) and build the paper, so that the GPU window's last step,
`make figures paper` on the campaign's results, does not fail on a shape the CPU never writes.

    from tests import gpu_shaped
    gpu_shaped.write_all(tmp_path / "results")     # results/<rq>/h100.csv (+ .json) per RQ

Each module has `write(results_dir)`; values are deterministic (a seeded generator).
"""

import contextlib
import importlib
import os

GPU = "NVIDIA H100 80GB HBM3"
TAG = "h100"
RQS = ("speedup", "io_complexity", "scaling", "long_context_training")


@contextlib.contextmanager
def as_gpu():
    """experiments.results writes GPU provenance (device name) while inside."""
    old = os.environ.get("LONGFLASH_DEVICE_NAME")
    os.environ["LONGFLASH_DEVICE_NAME"] = GPU
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LONGFLASH_DEVICE_NAME", None)
        else:
            os.environ["LONGFLASH_DEVICE_NAME"] = old


def path(results_dir, rq, ext="csv"):
    """results_dir/<rq>/h100.<ext>, its folder created."""
    folder = os.path.join(str(results_dir), rq)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{TAG}.{ext}")


def write_all(results_dir, rqs=RQS):
    """Every RQ's GPU-shaped results into results_dir (a scratch copy, never results/)."""
    for rq in rqs:
        importlib.import_module(f".{rq}", __name__).write(results_dir)
