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


def test_per_param_layout_cuts_each_tensor_as_torch_chunk():
    """FSDP2's cut (torch.chunk on dim 0, the last ranks padded): rank r's shard is its chunk of every tensor,
    zero-padded to ceil(dim0 / N) rows; the compute order has each tensor whole, and the two orders convert."""
    from minizero.zero.per_param_layout import PerParamLayout
    shapes = [(7, 5), (13,), (2, 3), (1,)]  # at N = 4: 2, 4, 1 and 1 rows a rank; (2, 3) and (1,) leave ranks empty
    lay = PerParamLayout(shapes, world_size=4)
    assert (lay.numel, lay.shard_numel, lay.padded_numel) == (55, 2 * 5 + 4 + 3 + 1, 4 * 18)
    ts = [torch.randn(s) for s in shapes]
    flat = lay.flatten(ts)
    for r in range(4):
        shard = lay.shard(flat, r)
        for i, t in enumerate(ts):
            chunks = torch.chunk(t, 4)
            want = chunks[r] if r < len(chunks) else t[:0]
            assert lay.local_shape(i, r) == want.shape
            a = lay.shard_offsets[i]
            piece = shard[a:a + lay.chunk_numels[i]]
            assert torch.equal(piece[:want.numel()], want.reshape(-1)) and not piece[want.numel():].any()
        for p in lay.pieces(r):  # the pieces are the rows this rank holds, as flat ranges of the tensor
            assert torch.equal(shard[p.shard_lo:p.shard_lo + p.hi - p.lo], ts[p.index].reshape(-1)[p.lo:p.hi])
    compute = lay.to_compute(flat)
    for t, a, n in zip(ts, lay.offsets, lay.numels):
        assert torch.equal(compute[a:a + n], t.reshape(-1))
    assert sum(n for n, _ in lay.compute_sizes()) == lay.padded_numel
    assert torch.equal(lay.to_comm(compute), flat)
