"""hydra/launcher=slurm_gpu: several GPUs per cell are several tasks, one per GPU."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from dofla.cli import CONF_DIR

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


@pytest.mark.parametrize("gpus", [1, 4])
def test_a_cell_gets_one_task_per_gpu(gpus):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm_gpu", "hydra.launcher.partition=gpu",
                                                       f"hydra.launcher.gpus_per_node={gpus}"],
                      return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)  # the submitit plugin's launcher, as Hydra builds it
    assert type(launcher).__name__ == "SlurmLauncher"
    assert (launcher.params["gpus_per_node"], launcher.params["tasks_per_node"]) == (gpus, gpus)
