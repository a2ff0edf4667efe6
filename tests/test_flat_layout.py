import torch

from minizero.zero.flat_layout import FlatLayout


def test_layout_pads_to_multiple_of_world_and_round_trips():
    shapes = [(7, 5), (13,), (2, 3)]  # 35 + 13 + 6 = 54 elements
    lay = FlatLayout(shapes, world_size=4)
    assert (lay.numel, lay.shard_numel, lay.padded_numel, lay.padding) == (54, 14, 56, 2)
    ts = [torch.randn(s) for s in shapes]
    flat = lay.flatten(ts)
    assert flat.shape == (56,) and torch.all(flat[54:] == 0)
    for t, v in zip(ts, lay.views(flat)):
        assert torch.equal(t, v) and v.data_ptr() >= flat.data_ptr()
    # the shards tile the buffer, and the pieces of each shard reassemble every tensor
    rebuilt = [torch.zeros(s).view(-1) for s in shapes]
    for r in range(4):
        shard = lay.shard(flat, r)
        assert shard.numel() == 14
        for p in lay.pieces(r):
            rebuilt[p.index][p.lo:p.hi] = shard[p.shard_lo:p.shard_lo + p.hi - p.lo]
    for t, b in zip(ts, rebuilt):
        assert torch.equal(t.view(-1), b)


def test_world_of_one_has_no_padding():
    lay = FlatLayout([(3, 3)], world_size=1)
    assert lay.padding == 0 and lay.pieces(0)[0] == lay.pieces(0)[0] and lay.pieces(0)[0].hi == 9
