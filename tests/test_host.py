"""minizero/host.py's strict mode: what it marks, what it refuses, and that it changes no value.

On a GPU an offload tier's tensors are CPU tensors and the communicator's are CUDA ones; the strict mode
makes that difference visible on a CPU-only machine. tests/test_offload.py runs every offload family
through it on 2 ranks; these are its rules, in one process."""
import io

import pytest
import torch

from minizero import comm, host


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("MINIZERO_STRICT_HOST", "1")


def test_unmarked_without_the_variable(monkeypatch):
    monkeypatch.delenv("MINIZERO_STRICT_HOST", raising=False)
    assert type(host.zeros(3)) is torch.Tensor and not host.is_host(host.empty(3))


def test_marks_follow_the_data_until_it_moves(strict):
    h = host.zeros(4) + 1
    assert host.is_host(h) and host.is_host(h.float().pow(2).sum()) and h.device == host.HOST
    assert host.is_host(torch.zeros(1, device=h.device)), "made on a host tensor's device: a host tensor"
    moved = h.to(torch.device("cpu"))
    assert type(moved) is torch.Tensor and torch.equal(moved, torch.ones(4))
    assert host.is_host(host.to_host(torch.ones(2), torch.float64))


def test_host_and_device_in_one_op_raise_as_on_a_gpu(strict):
    h, d = host.zeros(4), torch.ones(4)
    with pytest.raises(RuntimeError, match="same device.*MINIZERO_STRICT_HOST"):
        h.add_(d)
    d.copy_(h)  # a copy crosses the bus: allowed both ways
    assert torch.equal(d + h.sum(), torch.zeros(4)), "a 0-dim host tensor is a scalar with device ones"


@pytest.fixture
def world():
    """A world of one in this process, gone after the test (later tests start with none)."""
    assert not comm.is_initialized()
    yield comm.init()
    comm.shutdown()


def test_a_collective_refuses_a_host_tensor(strict, world):
    with pytest.raises(ValueError, match="all_reduce: tensor on the host, communicator world"):
        world.all_reduce(host.zeros(2) * 3)
    t = (host.zeros(2) + 3).to(world.device)
    world.all_reduce(t)
    assert t.tolist() == [3.0, 3.0]


def test_saved_as_a_plain_tensor(strict):
    buf = io.BytesIO()
    torch.save({"m": host.zeros(3) + 2}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["m"]
    assert type(loaded) is torch.Tensor and loaded.tolist() == [2.0, 2.0, 2.0]
