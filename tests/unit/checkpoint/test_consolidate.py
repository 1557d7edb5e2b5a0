"""checkpoint/consolidate.py: a ZeRO checkpoint's weights are read without unpickling arbitrary objects. (Real
ZeRO-2/3 checkpoints consolidated and exported: launched/test_export_zero.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from disco_clip_ds.checkpoint.consolidate import load_state_dict
from disco_clip_ds.errors import ExportError


class Planted:
    """What a forger puts in a checkpoint: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def zero_layout(folder, optim_states) -> None:
    """A ZeRO-2 checkpoint's layout: `latest`, model states that parse (no weights), and `optim_states` as rank 0's
    optimizer partition."""
    tag = folder / "global_step1"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("global_step1")
    model_states = {"buffer_names": [], "module": {}, "param_shapes": [{}], "shared_params": {}, "ds_version": "0"}
    torch.save(model_states, tag / "mp_rank_00_model_states.pt")
    torch.save(optim_states, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


@pytest.mark.slow  # beyond the fast tier's time budget
def test_a_planted_pickle_in_an_optimizer_partition_is_refused_unrun(tmp_path, capsys):
    """DeepSpeed's zero_to_fp32 loads partitions with weights_only=False: the planted code would run."""
    marker = tmp_path / "planted-code-ran"
    zero_layout(tmp_path / "checkpoint-1", {"optimizer_state_dict": Planted(marker)})
    partition = tmp_path / "checkpoint-1" / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(ExportError) as refused:
        load_state_dict(tmp_path / "checkpoint-1")
    assert not marker.exists()
    message = str(refused.value)
    assert message.startswith(f"refused to read '{partition}': it holds a pickled posix.mkdir"), message
    assert "\n" not in message
    assert capsys.readouterr().err == ""  # no progress bar left standing before the refusal


def test_the_loads_are_weights_only_only_while_consolidating(tmp_path):
    """The replaced loader is zero_to_fp32's alone, and only for the call: torch.load elsewhere is untouched."""
    from deepspeed.utils import zero_to_fp32

    zero_layout(tmp_path / "checkpoint-1", {"optimizer_state_dict": {}})
    with pytest.raises(ExportError, match="partial or corrupt"):  # parses the model states, then finds no stage
        load_state_dict(tmp_path / "checkpoint-1")
    assert zero_to_fp32.torch is torch and zero_to_fp32.tqdm.__name__ == "tqdm"
