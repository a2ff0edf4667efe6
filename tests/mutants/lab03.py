"""Student bugs in solutions/lab03_loss_scaler.py (the fp16 loss scaler). See tests/mutants/__init__.py for the
record."""
from tests.mutants import Mutant

MUTANTS = [
    Mutant("tests the sum of each gradient for inf/nan (a finite fp16 gradient's sum can overflow)",
           "torch.isfinite(g).all()", "torch.isfinite(g.sum())",
           "check_overflow_vote", "SUM"),
    Mutant("looks for inf only, so a nan gradient trains on (wrong dtype path: nan is not inf)",
           "not bool(torch.isfinite(g).all())", "bool(torch.isinf(g).any())",
           "check_overflow_vote", "nan"),
    Mutant("each rank decides alone: no vote, so ranks skip different steps",
           "        if comm is not None:\n            comm.all_reduce(flag, op=\"max\")\n", "",
           "check_skip", "every rank must skip"),
    Mutant("votes with min instead of max: skips only when every rank overflowed",
           "comm.all_reduce(flag, op=\"max\")", "comm.all_reduce(flag, op=\"min\")",
           "check_overflow_vote", "op='max'"),
    Mutant("halving the scale refills the hysteresis budget",
           "                self.cur_scale = max(self.cur_scale / 2, self.min_loss_scale)\n",
           "                self.cur_scale = max(self.cur_scale / 2, self.min_loss_scale)\n"
           "                self.cur_hysteresis = self.hysteresis\n",
           "check_update_rule", "DeepSpeed's rule"),
    Mutant("doubles after window good steps instead of window + 1 (DeepSpeed's off-by-one missed)",
           "stable = self.cur_iter - self.last_overflow_iter - 1", "stable = self.cur_iter - self.last_overflow_iter",
           "check_update_rule", "DeepSpeed's rule"),
    Mutant("ignores consecutive_hysteresis (the budget is refilled only when the scale doubles)",
           "            if self.consecutive_hysteresis:\n                self.cur_hysteresis = self.hysteresis\n", "",
           "check_update_rule", "DeepSpeed's rule"),
]
