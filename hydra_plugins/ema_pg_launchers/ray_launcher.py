"""``hydra/launcher=ema_pg_ray``: a Hydra multirun's jobs as tasks of a Ray cluster.

    python -m ema_pg.train -m --config-dir sweeps --config-name fig7_eta_direction \\
        hydra/launcher=ema_pg_ray hydra.launcher.address=auto hydra.launcher.cpus_per_job=2
    python -m ema_pg.reproduce table2 --scale mini --launcher ray --address auto    # the same, for a reproduction

Each job is what Hydra's basic launcher would run in this process (the sweep's config of that job, its folder
``hydra.sweep.dir/hydra.sweep.subdir``), run by a Ray task instead, all of a batch at once: the cluster's CPUs set how
many run together. The jobs' results come back in the sweep's order. The nodes need the checkout and the environment
at the same paths, and ``hydra.sweep.dir`` on a file system they share. A Hydra plugin (it must live in the
``hydra_plugins`` package); the Ray connection is :func:`ema_pg.workbench.launchers.ray_init`'s.
"""


import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.ema_pg_launchers.ray_launcher.RayLauncher"
    address: Optional[str] = None  #: a cluster's HOST:PORT or auto; None: $RAY_ADDRESS where set, else a Ray of this process
    cpus_per_job: int = 1  #: CPUs each job asks the cluster for
    num_cpus: int = 2  #: the CPUs of a Ray of this process (address None)


ConfigStore.instance().store(group="hydra/launcher", name="ema_pg_ray", node=RayLauncherConf, provider="ema_pg")


def _job(hydra_context, task_function, sweep_config) -> JobReturn:
    """One job, in a Ray worker: as Hydra's basic launcher runs it in its own process."""
    setup_globals()
    return run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


class RayLauncher(Launcher):
    def __init__(self, address: Optional[str] = None, cpus_per_job: int = 1, num_cpus: int = 2) -> None:
        self.address, self.cpus_per_job, self.num_cpus = address, cpus_per_job, num_cpus
        self.config = self.task_function = self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import ray

        from ema_pg.workbench.launchers import ray_init

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        ray_init(self.address, self.num_cpus)
        remote = ray.remote(num_cpus=self.cpus_per_job, max_retries=0)(_job)
        log.info(f"Launching {len(job_overrides)} jobs on Ray")
        refs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
            refs.append(remote.remote(self.hydra_context, self.task_function, sweep_config))
        return ray.get(refs)
