"""checkpoint.final_model on run folders made in place: the final model verifies only with its manifest (written
last by the final save), and one that does not is rewritten from the last checkpoint's weight files. (From a ZeRO-3
checkpoint without full weights, and on launched runs: launched/test_integrity_and_full_disk.py.)"""

from __future__ import annotations

from disco_clip_ds.checkpoint.final_model import final_model_problem, keep_final_model
from disco_clip_ds.checkpoint.manifest import MANIFEST, write_manifest


def test_the_final_model_verifies_only_with_its_manifest(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert final_model_problem(run) == "missing"
    (run / "model.safetensors").write_bytes(b"weights")
    assert final_model_problem(run) == f"no {MANIFEST}: the final save did not complete"
    write_manifest(run, ["model.safetensors"])
    assert final_model_problem(run) is None
    (run / "model.safetensors").write_bytes(b"weight")
    assert final_model_problem(run) == "model.safetensors is 6 bytes, the manifest says 7"
    (run / "model.safetensors").unlink()  # deleted after a complete save: the manifest still lists it
    assert final_model_problem(run) == "model.safetensors is missing (the manifest lists it)"


def test_a_final_model_that_does_not_verify_is_rewritten_from_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    checkpoint = run / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    for name, content in (("model.safetensors", b"trained"), ("config.json", b"{}"), ("rng_state_0.pth", b"rng")):
        (checkpoint / name).write_bytes(content)
    (run / "model.safetensors").write_bytes(b"cut")  # a final save cut short: no manifest
    message = keep_final_model(run, checkpoint)
    assert message == (
        f"run finished at checkpoint-3, but its final model was not usable (no {MANIFEST}: the final save did not "
        f"complete): rewritten in {run} from checkpoint-3 (config.json, model.safetensors), the weights the run "
        "ended with"
    )
    assert (run / "model.safetensors").read_bytes() == b"trained" and not (run / "rng_state_0.pth").exists()
    assert final_model_problem(run) is None
    assert keep_final_model(run, checkpoint) is None  # verified: untouched
