"""The pure-torch quantizers of ZeRO++ (minizero/zero/quantize.py), in one process, no ranks.

The bound: symmetric absmax quantization rounds x / scale to the nearest integer, so each
element is off by at most half a step, |x - dq(q(x))| <= scale / 2, scale = max|block| / qmax.
Float arithmetic (the division, the product) may add a few ulps: the tests allow |x| * 2^-22."""
import math

import pytest
import torch

from minizero.zero.quantize import (CHUNK_NUMEL, decode, dequantize_blockwise, encode, pack_int4,
                                    quantize_blockwise, unpack_int4)

SIZES = [1, 2, 7, 64, 100, 511, 1000]       # odd, even, smaller and larger than a block
BLOCKS = [1, 3, 64, 128, 2048]


def _per_element_scale(scales, block, n):
    return scales.repeat_interleave(block, dim=1)[:, :n]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", BLOCKS)
def test_error_at_most_half_a_step_per_block_at_odd_sizes(bits, block):
    gen = torch.Generator().manual_seed(bits * 1000 + block)
    for n in SIZES:
        # rows of very different magnitudes and an outlier: per-block scales must keep them apart
        x = torch.randn(3, n, generator=gen) * torch.tensor([[1e-3], [1.0], [50.0]])
        x[1, n // 2] = 400.0
        codes, scales = quantize_blockwise(x, block, bits)
        assert codes.dtype == torch.int8 and codes.shape == (3, n) and codes.is_contiguous()
        assert scales.dtype == torch.float32 and scales.shape == (3, math.ceil(n / block))
        qmax = 2 ** (bits - 1) - 1
        assert int(codes.abs().max()) == qmax  # each block's largest |x| maps to +-qmax
        back = dequantize_blockwise(codes, scales, block)
        bound = _per_element_scale(scales, block, n) / 2 + x.abs() * 2 ** -22
        excess = (x - back).abs() - bound
        assert float(excess.max()) <= 0, (f"n={n}, block={block}, bits={bits}: error exceeds scale/2 by "
                                          f"{float(excess.max()):.3g}")
        # the bound is per block: a block far from the outlier keeps its own fine scale
        if n >= 2 * block and block > 1:
            far = 0 if n // 2 >= block else -1
            assert scales[1, far] < scales[1, (n // 2) // block] / 10


def test_a_hand_computed_example():
    # blocks of 2: [1, -2] -> scale 2/127, codes round(63.5) = 64 (ties to even), -127; [0.5] -> 0.5/127, 127
    codes, scales = quantize_blockwise(torch.tensor([1.0, -2.0, 0.5]), 2)
    assert codes.tolist() == [[64, -127, 127]]
    assert torch.allclose(scales, torch.tensor([[2 / 127, 0.5 / 127]]))
    back = dequantize_blockwise(codes, scales, 2)[0]
    assert abs(back[0].item() - 64 * 2 / 127) < 1e-7 and abs(back[0].item() - 1.0) <= 1 / 127


def test_zero_block_is_exact_and_1d_input_is_one_row():
    x = torch.tensor([0.0, 0.0, 0.0, 3.0, -1.5])
    codes, scales = quantize_blockwise(x, 3, bits=4)
    assert scales[0, 0] == 0 and codes[0, :3].tolist() == [0, 0, 0]
    assert codes[0, 3:].tolist() == [7, -4]  # 3 -> 7 steps of 3/7; -1.5 / (3/7) = -3.5 -> -4 (ties to even)
    assert torch.equal(dequantize_blockwise(codes, scales, 3)[0, :3], torch.zeros(3))


def test_int4_packs_two_codes_per_byte_odd_lengths():
    for n in (1, 2, 5, 6, 9):
        codes = torch.randint(-7, 8, (2, n), dtype=torch.int8)
        packed = pack_int4(codes)
        assert packed.dtype == torch.uint8 and packed.shape == (2, math.ceil(n / 2))
        assert torch.equal(unpack_int4(packed, n), codes)
    # the layout: low nibble first, codes offset by 8
    assert pack_int4(torch.tensor([[-7, 7]], dtype=torch.int8)).tolist() == [[1 | (15 << 4)]]


@pytest.mark.parametrize("bits", [8, 4])
def test_wire_format_round_trips_and_has_the_byte_count_of_the_formula(bits):
    x = torch.randn(4, 777)
    wire = encode(x, 100, bits)
    code_bytes = 777 if bits == 8 else 389
    assert wire.dtype == torch.uint8 and wire.shape == (4, code_bytes + 4 * 8)  # 8 blocks of 100, fp32 scales
    codes, scales = quantize_blockwise(x, 100, bits)
    assert torch.equal(decode(wire, 777, 100, bits), dequantize_blockwise(codes, scales, 100))


@pytest.mark.parametrize("bits, block", [(4, 7), (8, 2048), (4, 1)])
def test_encode_in_chunks_equals_quantizing_at_once(bits, block):
    """encode/decode work a chunk of whole blocks at a time (cache-sized); the codes must not change,
    at a length spanning chunks with a short last block and an odd last int4 byte, on one row (an
    unaligned offset for the scales) and on several, into a 16-bit `out` too."""
    n = 2 * CHUNK_NUMEL + 2 * block + 1
    for rows in (1, 3):
        x = torch.randn(rows, n)
        codes, scales = quantize_blockwise(x, block, bits)
        want = dequantize_blockwise(codes, scales, block)
        wire = encode(x, block, bits)
        assert wire.shape == (rows, (n if bits == 8 else (n + 1) // 2) + 4 * math.ceil(n / block))
        assert torch.equal(decode(wire, n, block, bits), want)
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        assert decode(wire, n, block, bits, out=out) is out and torch.equal(out, want.bfloat16())


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "64"])
def test_block_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="block_numel must be a positive int"):
        quantize_blockwise(torch.ones(4), bad)
    with pytest.raises(ValueError, match="block_numel must be a positive int"):
        dequantize_blockwise(torch.ones(1, 4, dtype=torch.int8), torch.ones(1, 1), bad)


def test_only_int8_and_int4():
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_blockwise(torch.ones(4), 2, bits=2)
