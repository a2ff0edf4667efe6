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
import os
import subprocess

import pytest
import torch

from minizero import launch
from minizero.runtime import checkpoint
from minizero.cli import main as cli
from minizero.models import build_model

pytestmark = pytest.mark.launches  # starts ranks or processes: not in `make check`

W = "tests/checkpoint_workers.py:"
GPT = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)  # = the workers'
CASES = [f"{s}/{d}" for d in ("fp32", "fp16") for s in range(4)]


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """(a real 1 MiB tmpfs, None) where mount works (root), else (None, why not)."""
    d = tmp_path_factory.mktemp("full")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
        why = r.returncode and f"cannot mount a small tmpfs here: {(r.stderr.strip().splitlines() or ['?'])[0]}"
    except OSError as ex:
        why = f"cannot mount a small tmpfs here: {ex}"
    yield (None, why) if why else (d, None)
    if not why:
        subprocess.run(["umount", str(d)], check=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, full_disk):
    root = tmp_path_factory.mktemp("ckpt")
    full = str(full_disk[0]) if full_disk[0] else None
    return root, launch.run(W + "resume", nprocs=2, args={"root": str(root), "full": full}, timeout=300)


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
                "wrong_model": "holds a different model"}
    for name, text in expected.items():
        assert e[name]["error"] and text in e[name]["error"], (name, e[name]["error"])
        assert "Nothing was loaded" in e[name]["error"] and e[name]["unchanged"], name
    assert "'wte.weight' [64, 32] there, 'wte.weight' [64, 48] here" in e["wrong_model"]["error"]
    # no `latest` and no tag: DeepSpeed's answer, (None, None) and a warning (rank 0's), nothing loaded
    assert list(e["no_latest"]["returned"]) == [None, None] and e["no_latest"]["unchanged"]
    assert any("no 'latest' file" in w and "nothing was loaded" in w for w in e["no_latest"]["warnings"])
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


def test_a_disk_full_on_one_rank_is_named_and_leaves_nothing(saved):
    """Rank 1's torch.save fails as on a full disk; rank 0 wrote its file: every rank raises the same
    "disk is full" naming the directory, the hidden .bad.tmp-* is gone, `latest` still names the good one."""
    for rank, r in enumerate(saved[1]):
        c = r["errors"]["disk_full"]["fake"]
        assert c["error"].startswith("rank 1 could not write ") and "/.bad.tmp-" in c["error"], (rank, c["error"])
        assert f"the disk is full: no space left in {c['dir']} (RuntimeError: [enforce fail" in c["error"]
        assert c["listing"] == ["good", "latest"] and c["latest"] == "good", (rank, c["listing"])


def test_a_really_full_disk_is_named_and_leaves_nothing(saved, full_disk):
    """A real 1 MiB tmpfs with 16 KiB left: the OSError torch.save hides behind "unexpected pos" is found."""
    if full_disk[0] is None:
        pytest.skip(full_disk[1])
    for rank, r in enumerate(saved[1]):
        c = r["errors"]["disk_full"]["real"]
        assert min(c["rank_file_bytes"]) > 16384, c["rank_file_bytes"]  # neither rank's file fits in what is left
        assert c["error"].startswith("rank 0 could not write "), (rank, c["error"])
        assert f"the disk is full: no space left in {full_disk[0]} (" in c["error"], c["error"]
        assert c["listing"] == ["filler", "good", "latest"] and c["latest"] == "good", (rank, c["listing"])


def test_consolidate_into_a_directory_is_one_clear_error(saved, tmp_path, capsys):
    """Checked before anything is read or written: exit 2, says what to pass, no OUT.part anywhere."""
    out = tmp_path / "out"
    out.mkdir()
    assert cli(["consolidate", str(saved[0] / "s0_fp32"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"consolidate: {out} is a directory: pass the file to write, e.g. {out / 'model.pt'}\n"
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == []
    assert cli(["consolidate", str(saved[0] / "s0_fp32"), str(tmp_path / "no" / "model.pt")]) == 2
    assert f"{tmp_path / 'no'} does not exist" in capsys.readouterr().err and sorted(os.listdir(tmp_path)) == ["out"]


def test_write_atomic_leaves_no_part_file(tmp_path):
    def boom(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        checkpoint._write_atomic(str(tmp_path / "a.pt"), boom)
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):  # the replace fails after the whole file was written
        checkpoint._write_atomic(str(tmp_path / "d"), lambda f: f.write(b"whole"))
    assert sorted(os.listdir(tmp_path)) == ["d"] and os.listdir(tmp_path / "d") == []


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
    """No such folder: a usage error (exit 2); a folder without a checkpoint: exit 1, saying so."""
    with pytest.raises(SystemExit) as e:
        cli(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.pt")])
    assert e.value.code == 2 and "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli(["consolidate", str(tmp_path / "empty"), str(tmp_path / "x.pt")]) == 1
    assert "no checkpoint in" in capsys.readouterr().err and not (tmp_path / "x.pt").exists()


def test_consolidate_of_a_train_run_folder_names_its_checkpoints_folder(tmp_path, capsys):
    """`minizero train --out RUN` saves into RUN/checkpoints: given RUN, the message says where to look."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("global_step3")
    assert cli(["consolidate", str(run), str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert f"its checkpoints are in {run / 'checkpoints'}" in err and not (tmp_path / "x.pt").exists()


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
