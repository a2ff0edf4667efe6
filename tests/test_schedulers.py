import math

import pytest
import torch

from minizero.runtime.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def _opt(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _trace(sched, n):
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0])
        sched.step()
    return out


# lrs[i] is the learning rate of optimizer step i + 1: DeepSpeed's schedules start at last_batch_iteration -1
# (deepspeed/runtime/lr_schedules.py), so steps 1 and 2 both run at the start value and lrs[i] = lr(t = i - 1)
def test_warmup_lr_log_and_linear():
    lrs = _trace(WarmupLR(_opt(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10), 14)
    assert lrs[0] == lrs[1] == 0.0 and lrs[2] == pytest.approx(0.1 * math.log(2) / math.log(10))
    assert lrs[5] == pytest.approx(0.1 * math.log(5) / math.log(10))
    assert lrs[10] == pytest.approx(0.1) and lrs[11:] == [0.1, 0.1, 0.1]
    lin = _trace(WarmupLR(_opt(), 0.0, 0.1, 10, warmup_type="linear"), 12)
    assert lin[:2] == [0.0, 0.0] and lin[6] == pytest.approx(0.05) and lin[11] == 0.1


def test_warmup_decay_reaches_zero_at_total():
    lrs = _trace(WarmupDecayLR(_opt(), total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10), 23)
    assert lrs[11] == pytest.approx(0.1) and lrs[16] == pytest.approx(0.05) and lrs[21] == 0.0 and lrs[22] == 0.0


def test_warmup_cosine_scales_optimizer_lr():
    s = WarmupCosineLR(_opt(lr=0.5), total_num_steps=110, warmup_num_steps=10, cos_min_ratio=0.1, warmup_type="linear")
    lrs = _trace(s, 130)
    assert lrs[0] == lrs[1] == 0.0 and lrs[6] == pytest.approx(0.25)
    assert lrs[110] == pytest.approx(0.5 * 0.1, rel=1e-6)  # the end of the cosine: cos_min_ratio
    assert lrs[60] == pytest.approx(0.5 * (0.1 + 0.9 * 0.5), rel=1e-6)
    assert lrs[111:] == pytest.approx([0.05] * 19, rel=1e-6)  # past the end it stays there (no second cosine)


def test_state_round_trip_and_bad_spec():
    a = WarmupLR(_opt(), 0.0, 0.1, 10)
    for _ in range(4):
        a.step()
    opt = _opt()
    b = WarmupLR(opt, 0.0, 0.1, 10)
    b.load_state_dict(a.state_dict())
    assert b.get_last_lr() == a.get_last_lr() and opt.param_groups[0]["lr"] == a.get_last_lr()[0]
    with pytest.raises(ValueError, match="WarmupLR"):
        build_scheduler(_opt(), {"type": "WarmupLR", "params": {"warmup_max": 1}})


def test_every_schedule_is_deepspeeds_to_the_last_bit():
    """The learning rate of each of 40 steps equals real DeepSpeed's exactly (not approximately: a last-bit
    difference in lr parts two runs' losses), over warm-ups of 1-13 steps, both warm-up types, three lengths."""
    try:
        from deepspeed.runtime import lr_schedules as real
    except ImportError:
        pytest.skip("deepspeed is not installed: pip install -e '.[peers]' (deepspeed==0.19.8; no C++ op is built)")
    ours = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
    compared = 0
    for warmup in (1, 2, 3, 5, 7, 13):
        for total in (5, 10, 30):
            for kind in ("log", "linear"):
                for name, kw in [
                        ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.03)),
                        ("WarmupDecayLR", dict(total_num_steps=total, warmup_min_lr=0.0, warmup_max_lr=0.03)),
                        ("WarmupCosineLR", dict(total_num_steps=total, warmup_min_ratio=0.1, cos_min_ratio=0.05))]:
                    kw.update(warmup_num_steps=warmup, warmup_type=kind)
                    theirs = _trace(getattr(real, name)(_opt(0.01), **kw), 40)
                    assert _trace(ours[name](_opt(0.01), **kw), 40) == theirs, (name, kw)
                    compared += 1
    assert compared == 108
