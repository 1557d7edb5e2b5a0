"""The names the tests import from here, now in the shared harness (disco_clip_ds.testing): launching runs
(testing.launch), their processes (testing.processes) and what they leave behind (testing.runs). A thin re-export
until the tests import them from there."""

from disco_clip_ds.testing.launch import run_to_end, start_run
from disco_clip_ds.testing.processes import alive, kill_group, ranks_of, wait_group
from disco_clip_ds.testing.runs import (
    assert_same_training,
    assert_trained_under_fsdp,
    complete_checkpoints,
    run_and_data,
    same_weights,
    save_initial_model,
    step_losses,
    two_shards_and_init,
    weights,
)

__all__ = [
    "alive",
    "assert_same_training",
    "assert_trained_under_fsdp",
    "complete_checkpoints",
    "kill_group",
    "ranks_of",
    "run_and_data",
    "run_to_end",
    "same_weights",
    "save_initial_model",
    "start_run",
    "step_losses",
    "two_shards_and_init",
    "wait_group",
    "weights",
]
