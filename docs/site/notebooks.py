"""Run a lesson notebook once, for both its test and the site.

tests/test_lessons.py executes every lessons/*.ipynb (committed without outputs) and keeps the
executed copy in build/lessons/ (git-ignored) with where and when it ran stamped in its metadata;
`make site` renders those copies, and executes a lesson itself only when its copy is missing or
was made from other code than the notebook's now (a digest of the code cells says which). Prose is
not executed: a copy whose code is current is shown with the notebook's markdown cells as they are
now, so fixing a heading or a sentence costs no run."""
import datetime
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = ROOT / "build" / "lessons"
HANG_S = 600  # per cell: a cell still running after this is hung (launch jobs time out well before)


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def digest(nb) -> str:
    """sha256 of the code cells' sources, in order: what decides whether an executed copy is current
    (markdown cells change no output; executed_copy takes them from the notebook)."""
    code = [_source(c) for c in nb["cells"] if c["cell_type"] == "code"]
    return hashlib.sha256(json.dumps(code).encode()).hexdigest()


def machine() -> dict:
    """Where a notebook ran: the reader of a page needs it to know whose numbers these are."""
    import torch
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
                 platform.processor())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cores": os.cpu_count(), "cpu": model, "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "system": f"{platform.system()} {platform.release()}"}


def _cpuinfo():
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def execute(path: Path, out_dir: Path = EXECUTED):
    """Execute `path` in a fresh kernel (cwd = repo root), stamp the run into its metadata
    (`minizero_run`: UTC start, seconds, load average before and after, the machine), write the
    executed copy to out_dir/<name> and return (notebook, seconds)."""
    import nbclient
    import nbformat
    nb = nbformat.read(path, as_version=4)
    source_digest = digest(nb)
    started, load_before, t0 = datetime.datetime.now(datetime.timezone.utc), os.getloadavg(), time.time()
    from jupyter_client import KernelManager
    with tempfile.TemporaryDirectory(prefix="minizero-kernel-") as sockets:
        # The kernel's channels on Unix sockets in a folder of its own, not on TCP ports: two
        # runs on one machine cannot take the same port, and the kernel has no plain-text TCP
        # to warn about. (transport "ipc" alone puts them at ./kernel-ipc-N, shared by all.)
        km = KernelManager(kernel_name="python3", transport="ipc",
                           ip=os.path.join(sockets, "kernel"))
        try:
            nbclient.NotebookClient(nb, km=km, timeout=HANG_S,
                                    resources={"metadata": {"path": str(ROOT)}}).execute()
        finally:  # nbclient shuts down only a kernel manager of its own making
            if km.has_kernel:
                km.shutdown_kernel()
    elapsed = time.time() - t0
    nb.metadata["minizero_run"] = {"started_utc": started.strftime("%Y-%m-%d %H:%M UTC"), "seconds": round(elapsed, 1),
                                   "load_before": [round(x, 2) for x in load_before],
                                   "load_after": [round(x, 2) for x in os.getloadavg()],
                                   "machine": machine(), "source_digest": source_digest}
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
    return nb, elapsed


def executed_copy(path: Path, out_dir: Path = EXECUTED):
    """The executed copy of `path` if there is one made from its current code, else None: the
    notebook's cells now, each code cell replaced by its executed twin (outputs and all)."""
    import nbformat
    copy = out_dir / path.name
    if not copy.exists():
        return None
    nb = nbformat.read(copy, as_version=4)
    now = nbformat.read(path, as_version=4)
    if nb.metadata.get("minizero_run", {}).get("source_digest") != digest(now):
        return None
    ran = iter([c for c in nb.cells if c.cell_type == "code"])
    nb.cells = [next(ran) if c.cell_type == "code" else c for c in now.cells]
    return nb
