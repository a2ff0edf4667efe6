"""Sharded checkpoints: bitwise resume, bad files that change nothing, atomic saves, resharding
to another world size or stage, and consolidation into the plain model's fp32 state dict.

Two launches: tests/checkpoint_workers.py:resume on 2 ranks writes the checkpoints into a
temporary directory; :reshard on 3 ranks loads them. Consolidation runs here (no ranks needed).
Tolerances: resuming at the same size and stage must be BITWISE. A resharded run continues the
same training (same global batch of 12 rows) with another reduction order: rtol 1e-5 on the loss
in fp32 (measured 1.6e-7 after 10 Adam steps), 2e-3 in fp16 (a few fp16 ulps of a loss near 4;
measured 2.8e-4); the state right after loading must still equal the files bit for bit.
"""
import hashlib

import pytest
import torch

from minizero import launch
from minizero.runtime import checkpoint
from minizero.cli import main as cli
from minizero.models import build_model

W = "tests/checkpoint_workers.py:"
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)  # = the workers'
CASES = [f"{s}/{d}" for d in ("fp32", "fp16") for s in range(4)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return root, launch.run(W + "resume", nprocs=2, args={"root": str(root)}, timeout=300)


@pytest.fixture(scope="module")
def resharded(saved):
    root, _ = saved
    return launch.run(W + "reshard", nprocs=3, args={"root": str(root)}, timeout=300)[0]


@pytest.mark.parametrize("case", CASES)
def test_resume_is_bitwise(saved, case):
    for rank, r in enumerate(saved[1]):
        c = r[case]
        assert c["resumed"] == c["second"], f"{case} rank {rank}: losses after resuming differ"
        assert c["differs"] == [], f"{case} rank {rank}: state differs after 10 more steps: {c['differs'][:5]}"
        assert c["second"] != c["first"] and c["path"] == f"s{case.replace('/', '_')}/global_step10"
        if case.endswith("fp16"):  # the loss scaler had work on both sides of the save
            before, total = c["skipped"]
            assert 0 < before < total, f"{case}: skipped {before} steps before the save, {total} in all"


def test_bad_checkpoints_are_refused_and_change_nothing(saved):
    e = saved[1][0]["errors"]
    expected = {"missing_shard": "the shard of rank 1 of 2 (rank1.pt) is missing",
                "truncated": "truncated or replaced", "corrupt": "checksum differs from meta.json",
                "no_latest": "there is no 'latest' file", "wrong_model": "holds a different model"}
    for name, text in expected.items():
        assert e[name]["error"] and text in e[name]["error"], (name, e[name]["error"])
        assert "Nothing was loaded" in e[name]["error"] and e[name]["unchanged"], name
    assert "'wte.weight' [64, 32] there, 'wte.weight' [64, 48] here" in e["wrong_model"]["error"]
    assert "middle of gradient accumulation" in e["mid_accumulation"]
    for r in saved[1]:  # rank 0 could not create the directory: every rank raised, none hung
        assert "cannot write into" in r["errors"]["unwritable"], r["errors"]["unwritable"]
    for rank, r in enumerate(saved[1]):  # every rank got the error, none hung
        assert all(r["errors"][n]["error"] for n in expected), rank


def test_interrupted_save_leaves_the_last_good_checkpoint(saved):
    i = saved[1][0]["errors"]["interrupted"]
    assert i["crashed"] and i["latest"] == "global_step2" and i["tags"] == ["global_step2", "latest"]
    assert len(i["leftovers"]) == 1 and i["leftovers"][0].startswith(".global_step4.tmp-")
    assert i["restored"], "loading `latest` after the crash did not give the last good state"


def _digest(sd):
    h = hashlib.sha256()
    for k, v in sd.items():
        h.update(k.encode() + v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("case", CASES)
def test_consolidate_gives_the_plain_models_fp32_state_dict(saved, case, tmp_path):
    root, res = saved
    out = tmp_path / "model.pt"
    assert cli(["consolidate", str(root / f"s{case.replace('/', '_')}"), str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert _digest(sd) == res[0][case]["saved"], "not the engine's full state at the save"
    model = build_model("tiny-gpt", seed=0, **GPT)
    model.load_state_dict(sd)  # strict: every key, tied lm_head.weight included
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("stage", [1, 3])
def test_consolidate_edge_model(saved, stage, tmp_path):
    """Tied, frozen and unused parameters and a buffer survive ZeRO-1/3 sharding and consolidation."""
    root, res = saved
    sd = checkpoint.consolidate(root / f"edge_s{stage}", tmp_path / "edge.pt")
    assert _digest(sd) == res[0]["edge"][str(stage)]
    model = build_model("edge", seed=0)
    model.load_state_dict(torch.load(tmp_path / "edge.pt", weights_only=True))
    assert torch.equal(model.frozen.weight, build_model("edge", seed=0).frozen.weight)  # never trained
    assert torch.equal(model.scale, sd["scale"]) and "head.weight" in sd


def test_consolidate_reports_a_bad_directory(tmp_path, capsys):
    assert cli(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == 1
    assert "no checkpoint in" in capsys.readouterr().err and not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("case", ["0/fp32->0", "1/fp32->1", "2/fp32->2", "3/fp32->3", "2/fp16->2",
                                  "1/fp32->3", "3/fp32->0", "1 rank"])
def test_reshard_to_another_world_size_and_stage(saved, resharded, case):
    """Saved at 2 ranks; loaded at 3 ranks (same stage, or another: 'stage/dtype->stage'), or 1."""
    r = resharded[case]
    assert r["differs"] == [], f"{case}: the loaded state is not the files' ({r['differs'][:5]})"
    assert r["loaded_at"] == 10
    src = "3/fp32" if case == "1 rank" else case.split("->")[0]
    ref = saved[1][0][src]["second"]  # the uninterrupted 2-rank run
    assert r["losses"] == pytest.approx(ref, rel=2e-3 if "fp16" in src else 1e-5), (case, r["losses"], ref)
