"""The trackers a run reports to beside its own files: Weights & Biases, MLflow and TensorBoard, each through
Lightning's logger for it (docs/tracking.md).

The run folder is the record (``metrics.csv``, ``eval.json``, the checkpoints); a tracker holds a copy of it, and the
copy is kept exact:

- **One tracker run per run, for the run's whole life.** Its id is written to ``<run>/tracking.json`` when it is
  created; a resume, a sweep's ``if_exists=resume``, a re-run of decide or hpo, and ``python -m ema_pg track import``
  continue that tracker run.
- **Every row once.** A row is sent when the checkpoint that covers it has been written (:class:`TrackerHub` holds
  the rows of the iterations since), so a tracker never holds an iteration that a resume runs again. Where a run
  continues, what the tracker already holds is read back (wandb's own ``.wandb`` files, MLflow's metric histories,
  TensorBoard's event files) and the rows of ``metrics.csv`` it lacks are sent: none missing (a kill -9 lost the
  rows that had not reached the tracker's files), none twice.
- **A tracker never costs the run.** A tracker that raises is set aside with one line naming it and what it missed;
  the run goes on, and ``track import RUN`` later sends what it missed.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, flatten
from .console import masked
from .files import atomic_write
from .install import trackers_of
from .runs import git_commit, in_multirun, machine, metrics_rows, run_base, run_commit, run_machine

log = logging.getLogger("ema_pg")

TRACKING_FILE = "tracking.json"  #: in a run folder (or a plan's): the tracker runs that mirror it, by tracker
STEP_KEY = "trainer/global_step"  #: the iteration of a row, as Lightning's WandbLogger logs it


# ---------------------------------------------------------------------- identity
@dataclass
class Identity:
    """How a run appears in a tracker: its name, group, job type, tags and hyperparameters (the resolved config,
    flattened, with the commit, machine, base policy, task and method)."""

    name: str
    group: str
    job_type: str
    tags: list[str]
    params: dict = field(default_factory=dict)
    step: int = 0  #: the step its summary row and final media take (the run's last iteration)


def default_group(cfg, run_dir: Path) -> str:
    """The group of a run whose config names none: its sweep (the multirun's folder: where this job runs, or the
    folder that holds the run and its ``multirun.yaml``), else its experiment's name."""
    sweep = None
    if (Path(run_dir).parent / "multirun.yaml").is_file():
        sweep = Path(run_dir).parent
    elif in_multirun():
        from hydra.core.hydra_config import HydraConfig

        sweep = Path(HydraConfig.get().sweep.dir)
    if sweep is None:
        return str(cfg.get("name") or "ema-pg")
    try:
        return str(sweep.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(sweep)


def method_of(cfg) -> str:
    return str(cfg.get("method") or f"{cfg.kl.name}+{cfg.anchor.name}")


def run_identity(cfg, run_dir: Path, group: str | None = None) -> Identity:
    """A run's identity from its resolved config and its folder; ``logger.*`` override each part."""
    from omegaconf import OmegaConf

    lc = cfg.logger
    tags = [method_of(cfg), f"seed={cfg.seed}", f"task={cfg.task.name}", *[str(t) for t in lc.get("tags", [])]]
    container = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    params = {k: v for k, v in flatten(container).items() if not k.startswith("logger.")}
    commit = run_commit(run_dir)
    commit = git_commit() if commit == "unknown" else commit
    mach = run_machine(run_dir)
    params.update({"run.commit": commit, "run.dirty": commit.endswith("-dirty"),
                   "run.machine": machine() if mach == "unknown" else mach, "run.base": run_base(run_dir),
                   "run.task": cfg.task.name, "run.method": method_of(cfg), "run.folder": str(Path(run_dir).resolve())})
    return Identity(name=lc.get("run_name") or Path(run_dir).name, group=lc.get("group") or group or default_group(cfg, run_dir),
                    job_type=lc.get("job_type") or "train", tags=list(dict.fromkeys(tags)), params=params,
                    step=int(cfg.algo.iterations))


# ---------------------------------------------------------------------- rows
def csv_rows(run_dir: Path, upto: int | None = None) -> list[tuple[int, dict]]:
    """The rows of a run folder's ``metrics.csv`` up to iteration ``upto`` (all: None), as (step, metrics)."""
    rows = metrics_rows(Path(run_dir) / "metrics.csv", 2**62 if upto is None else upto)
    return [(r.pop("step"), r) for r in rows]


def summary_row(run_dir: Path) -> tuple[int, dict] | None:
    """A finished run's outcome as a row at its last iteration: ``final/avg``, ``base/avg``, each split's final
    score (``final/<split>``) and the wall time, from its ``eval.json``."""
    f = Path(run_dir) / "eval.json"
    if not f.is_file():
        return None
    res = json.loads(f.read_text())
    metric = res.get("metric")
    row = {"final/avg": res.get("avg"), "base/avg": res.get("base_avg"), "time/wall_s": res.get("wall_s")}
    for name, split in (res.get("splits") or {}).items():
        if metric in split:
            row[f"final/{name}"] = split[metric]
    return int(res["iteration"]), {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and v == v}


def missing(rows: list[tuple[int, dict]], present: Counter, key=lambda k: k) -> list[tuple[int, dict]]:
    """The part of ``rows`` that a tracker holding ``present`` ((step, key) -> how many values) lacks: each value of
    a (step, key) counted once against what the tracker holds, in the rows' order."""
    held, out = Counter(present), []
    for step, row in rows:
        lack = {}
        for k, v in row.items():
            if held[(step, key(k))] > 0:
                held[(step, key(k))] -= 1
            else:
                lack[k] = v
        if lack:
            out.append((step, lack))
    return out


# ---------------------------------------------------------------------- wandb's files
_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """The protobuf ``Record``s of one ``.wandb`` file (wandb's transaction log: a 7-byte header ``:W&B``, magic
    0xBEE1, a version; then LevelDB's log format, 32 KiB blocks of checksummed chunks; a block's zero-filled rest,
    where its writer flushed it whole, is skipped). A torn tail (a killed process) ends the scan where the last whole
    record ends."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if len(data) < _HEADER or data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ValueError(f"{path}: not a wandb transaction log")
    pos, parts = _HEADER, []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if (crc, length, kind) == (0, 0, 0):  # the zero-filled rest of a block that was flushed whole
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        if kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or len(chunk) < length or \
                zlib.crc32(chunk, zlib.crc32(bytes((kind,)))) & 0xFFFFFFFF != crc:
            return  # the torn or zero-filled end of a file whose writer was killed
        pos += _HEADER + length
        if kind in (_FULL, _FIRST):
            parts = [chunk]
        else:
            parts.append(chunk)
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            yield rec


def wandb_files(run_dir: Path, run_id: str) -> list[Path]:
    """Every ``.wandb`` file of tracker run ``run_id`` under a run folder (one per process that wrote it, in
    order: a resumed run has one per segment, online or offline)."""
    root = Path(run_dir) / "wandb"
    return sorted(root.glob(f"*-{run_id}/run-{run_id}.wandb")) if root.is_dir() else []


def wandb_history(files: list[Path]) -> list[dict]:
    """The history rows of a wandb run's files, each as {key: value} (values JSON-decoded)."""
    rows = []
    for f in files:
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                row = {}
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                rows.append(row)
    return rows


def holders(f: Path) -> list[int] | None:
    """The processes that hold ``f`` open (Linux's /proc); None where that cannot be known."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target, found = str(Path(f).resolve()), []
    for pid in (p for p in os.listdir(proc) if p.isdigit()):
        try:
            if any(os.readlink(proc / pid / "fd" / fd) == target for fd in os.listdir(proc / pid / "fd")):
                found.append(int(pid))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def quiet_writer(f: Path, still: float = 2.0, timeout: float = 60.0) -> None:
    """Wait (up to ``timeout`` seconds) until the process that wrote ``f`` is done with it: wandb's service process
    outlives a killed run for a moment (it watches the run's pid) and still writes the last rows it was sent, which a
    resume would send again were they read before they land. Done is no process holding the file open, where the
    system says (Linux); elsewhere nothing written for ``still`` seconds."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        held = holders(f)
        if held == [] or (held is None and time.time() - f.stat().st_mtime >= still):
            return
        time.sleep(0.2)
    log.warning("%s: its writer still holds it after %.0f s; read as it is", f, timeout)


def wandb_present(files: list[Path], own: Path | None = None) -> Counter:
    """(step, key) -> how many values wandb's files hold; a file whose process did not finish (no exit record) is
    read once its writer is done with it, but ``own``, the file this process's run is writing."""
    own = Path(own).resolve() if own is not None else None
    for f in files:
        if Path(f).resolve() != own and not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(f)):
            quiet_writer(f)
    held = Counter()
    for row in wandb_history(files):
        if STEP_KEY in row:
            step = int(row[STEP_KEY])
            held.update((step, k) for k in row if not k.startswith("_") and k != STEP_KEY)
    return held


# ---------------------------------------------------------------------- the trackers
class Tracker:
    """One tracker's run: created or continued from its record in ``tracking.json``; every call may raise (the
    hub sets a tracker aside when one does)."""

    name = ""

    def __init__(self, lc, folder: Path, ident: Identity, record: dict):
        self.lc, self.folder, self.ident, self.record = lc, Path(folder), ident, dict(record)
        self.resumed = bool(record)
        self.media_key = self.name  #: in tracking.json's media_sent once the final plot and eval.json are sent

    def key(self, k: str) -> str:  # a metric's name as this tracker stores it
        return k

    def present(self) -> Counter:
        return Counter()

    def log_rows(self, rows: list[tuple[int, dict]]) -> None:
        raise NotImplementedError

    def sync(self, rows: list[tuple[int, dict]]) -> int:
        """Send the rows (of the record) this tracker lacks; returns how many rows were sent."""
        lack = missing(rows, self.present(), self.key)
        if lack:
            self.log_rows(lack)
        return len(lack)

    def media(self, step: int, image: Path | None = None, files: tuple = (), samples: dict | None = None) -> None:
        pass

    def summary(self, row: dict) -> None:
        pass

    def artifact(self, path: Path, kind: str, name: str, metadata: dict) -> None:
        """A file or folder kept with the run (an exported model, a checkpoint), with what it came from."""

    def finish(self, status: str) -> None:
        pass


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, lc, folder, ident, record):
        super().__init__(lc, folder, ident, record)
        import wandb
        from lightning.pytorch.loggers import WandbLogger
        from wandb.sdk.lib.runid import generate_id

        os.environ.setdefault("WANDB_SILENT", "true")  # wandb's banners and warnings stay off the run's console
        if wandb.run is not None:  # a run this process left open (a sweep's earlier job that raised): end it first
            wandb.finish()
        run_id = record.get("id") or generate_id()
        self.record = {"id": run_id, "project": lc.project}
        settings = wandb.Settings(silent=True, show_warnings=False, show_info=False, console="off", x_disable_stats=True,
                                  disable_git=True,
                                  mode="offline" if lc.offline else "online")
        self.logger = WandbLogger(project=lc.project, save_dir=str(folder), id=run_id, resume="allow",
                                  name=ident.name, group=ident.group, job_type=ident.job_type, tags=ident.tags,
                                  config=ident.params, offline=bool(lc.offline), settings=settings)
        self.logger._wandb_init.pop("anonymous", None)  # Lightning passes None, which wandb >= 0.22 warns about
        self.run = self.logger.experiment  # created now: its id is on record before any row is sent

    def present(self) -> Counter:
        return wandb_present(wandb_files(self.folder, self.record["id"]), own=Path(self.run.settings.sync_file))

    def log_rows(self, rows):
        for step, row in rows:
            self.logger.log_metrics(row, step=step)

    def media(self, step, image=None, files=(), samples=None):
        import wandb

        out = {STEP_KEY: step}
        if image is not None:
            out["curves"] = wandb.Image(str(image))
        if samples:
            out["samples"] = wandb.Table(columns=["split", "prompt", "response", "reward"],
                                         data=[[s, x["prompt"], x["response"], x["reward"]]
                                               for s, xs in samples.items() for x in xs])
        if len(out) > 1:
            self.run.log(out)
        for f in files:
            self.run.save(str(f), base_path=str(Path(f).parent), policy="now")

    def summary(self, row):
        self.run.summary.update(row)

    def artifact(self, path, kind, name, metadata):
        import wandb

        art = wandb.Artifact(name=name, type=kind, metadata=metadata)  # logged by this run: its lineage
        (art.add_dir if Path(path).is_dir() else art.add_file)(str(path))
        self.run.log_artifact(art)

    def finish(self, status):
        self.run.finish(exit_code={"success": 0, "interrupted": 75}.get(status, 1))


class MLflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, lc, folder, ident, record):
        super().__init__(lc, folder, ident, record)
        from lightning.pytorch.loggers import MLFlowLogger
        from mlflow import MlflowClient

        for name in ("mlflow", "alembic"):  # a new store's table creation, said at INFO on the console
            logging.getLogger(name).setLevel(logging.WARNING)
        for var, value in MLFLOW_PATIENCE.items():  # a server that went away costs seconds, not MLflow's minutes
            os.environ.setdefault(var, value)

        uri = mlflow_uri(lc)
        client = MlflowClient(uri)
        stores = dict(record.get("stores", {}))  # a folder sent to two stores (a local one, then a server) has a run in each
        run_id = stores.get(masked(uri))
        if run_id is None:
            exp_id = experiment_id(client, lc.project, uri)
            tags = {"mlflow.runName": ident.name, "ema_pg.group": ident.group, "ema_pg.job_type": ident.job_type,
                    **{t.split("=", 1)[0] if "=" in t else t: t.split("=", 1)[1] if "=" in t else "true"
                       for t in ident.tags[1:]}, "method": ident.tags[0]}
            run_id = client.create_run(exp_id, tags=tags, run_name=ident.name).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
        self.run_id, self.media_key = run_id, f"mlflow:{masked(uri)}"
        self.record = {"run_id": run_id, "tracking_uri": masked(uri), "stores": {**stores, masked(uri): run_id}}
        self.logger = MLFlowLogger(tracking_uri=uri, run_id=run_id)
        self.client = self.logger.experiment  # Lightning's client of the run
        held = client.get_run(run_id).data.params
        params = {self.key(k): str(v)[:6000] for k, v in ident.params.items()}
        new = {k: v for k, v in params.items() if k not in held}  # a param is written once (MLflow refuses a change)
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i:i + 100])

    def key(self, k):  # MLflow's names take letters, digits and _ - . / : and space
        return k.replace("@", "_at_")

    def present(self):
        held, run_id = Counter(), self.run_id
        for k in self.client.get_run(run_id).data.metrics:
            held.update((m.step, k) for m in self.client.get_metric_history(run_id, k))
        return held

    def log_rows(self, rows):
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        items = [Metric(self.key(k), float(v), now, step) for step, row in rows for k, v in row.items()]
        for i in range(0, len(items), 1000):  # MLflow's limit on one batch
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def media(self, step, image=None, files=(), samples=None):
        run_id = self.run_id
        if image is not None:
            self.client.log_artifact(run_id, str(image))
        for f in files:
            self.client.log_artifact(run_id, str(f))
        if samples:
            import pandas as pd

            df = pd.DataFrame([{"split": s, "iteration": step, "prompt": x["prompt"], "response": x["response"],
                                "reward": x["reward"]} for s, xs in samples.items() for x in xs])
            self.client.log_table(run_id, data=df, artifact_file=f"samples/iter_{step:06d}.json")

    def artifact(self, path, kind, name, metadata):
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path=f"{kind}/{name}")
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path=kind)
        self.client.set_tag(self.run_id, f"{kind}.{name}", json.dumps(metadata, sort_keys=True))

    def finish(self, status):
        self.client.set_terminated(self.run_id,
                                   {"success": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, lc, folder, ident, record):
        super().__init__(lc, folder, ident, record)
        self.record = {"dir": "tb"}
        self.dir = Path(folder) / "tb"
        self.logger = None
        self.resumed = any(self.dir.glob("events.out.tfevents.*"))
        if not self.resumed:
            self._open()
            self.logger.log_hyperparams(ident.params)
            self.logger.save()  # hparams.yaml beside the events

    def _open(self, purge_step: int | None = None):
        from lightning.pytorch.loggers import TensorBoardLogger

        kw = {} if purge_step is None else {"purge_step": purge_step}
        self.logger = TensorBoardLogger(save_dir=str(self.folder), name="tb", version="", default_hp_metric=False,
                                        **kw)

    def present(self):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        if not self.dir.is_dir():
            return Counter()
        acc = EventAccumulator(str(self.dir), size_guidance={"scalars": 0})
        acc.Reload()  # a restart's purge (a resume that sent rows again) is applied as TensorBoard applies it
        held = Counter()
        for tag in acc.Tags()["scalars"]:
            held.update((e.step, tag) for e in acc.Scalars(tag))
        return held

    def sync(self, rows):
        """TensorBoard cannot take a step back into a file: from the first step it lacks, a new event file
        supersedes the old ones (its purge step, as TensorBoard reads a restart) and every row from there is sent."""
        lack = missing(rows, self.present())
        if not lack:
            if self.logger is None:
                self._open()
            return 0
        first = min(step for step, _ in lack)
        self._open(purge_step=first)
        again = [(s, r) for s, r in rows if s >= first]
        self.log_rows(again)
        return len(again)

    def log_rows(self, rows):
        for step, row in rows:
            self.logger.log_metrics(row, step=step)
        self.logger.experiment.flush()

    def media(self, step, image=None, files=(), samples=None):
        w = self.logger.experiment
        if image is not None:
            import matplotlib.image

            w.add_image("curves", matplotlib.image.imread(str(image))[..., :3], step, dataformats="HWC")
        if samples:
            for s, xs in samples.items():
                w.add_text(f"samples/{s}", "\n\n".join(f"**reward {x['reward']:g}** `{x['prompt']!r}` → "
                                                       f"`{x['response']!r}`" for x in xs), step)
        w.flush()

    def finish(self, status):
        if self.logger is not None:
            self.logger.experiment.flush()
            self.logger.experiment.close()


#: how long MLflow's client waits on a server before the tracker is set aside (its defaults: 7 retries with
#: backoff and a 120 s timeout, minutes of a run's time per call); a user's own settings of these win
MLFLOW_PATIENCE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

BACKENDS = {"wandb": WandbTracker, "mlflow": MLflowTracker, "tensorboard": TensorBoardTracker}


def mlflow_uri(lc) -> str:
    """The MLflow store a run reports to: ``logger.mlflow_uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite file
    in the runs folder of the current directory (``runs/mlflow.db``)."""
    uri = lc.get("mlflow_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    root = Path.cwd() / "runs"
    root.mkdir(exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def default_artifacts(uri: str) -> str | None:
    """Where a new experiment of a local store keeps its artifacts (beside the store); a server chooses its own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


def experiment_id(client, name: str, uri: str) -> str:
    """The id of MLflow's experiment ``name``, created if none has it. Two runs that start together (a sweep's or a
    plan's parallel jobs) may both find none: the one whose creation the store refuses takes the other's."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=default_artifacts(uri))
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS" or (exp := client.get_experiment_by_name(name)) is None:
            raise
        return exp.experiment_id


def check_reachable(lc) -> None:
    """An online tracker that cannot be reached is one line before any model is built, naming the setting that
    switches to working offline."""
    import requests

    if lc.get("mlflow"):
        uri = mlflow_uri(lc)
        if uri.startswith(("http://", "https://")):
            try:
                requests.get(uri.rstrip("/") + "/health", timeout=5).raise_for_status()
            except requests.RequestException as e:
                raise ConfigError(f"logger.mlflow_uri={masked(uri)}: no MLflow server answers there "
                                  f"({type(e).__name__}); start one (mlflow server --port PORT) or unset "
                                  "logger.mlflow_uri (and MLFLOW_TRACKING_URI) for a local store in runs/") from None
    if lc.get("wandb") and not lc.get("offline", True):
        base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        try:
            requests.get(base, timeout=5)
        except requests.RequestException as e:
            raise ConfigError(f"logger.offline=false: wandb's server {masked(base)} cannot be reached "
                              f"({type(e).__name__}); set logger.offline=true (its files stay in the run folder; "
                              "wandb sync sends them later)") from None


# ---------------------------------------------------------------------- the hub
def read_record(folder: Path) -> dict:
    f = Path(folder) / TRACKING_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def write_record(folder: Path, record: dict) -> None:
    atomic_write(Path(folder) / TRACKING_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")


class Trackers:
    """The trackers of one folder (a run's, or a plan's): opened from its ``tracking.json``, each call guarded."""

    def __init__(self, lc, folder: Path, ident: Identity, names: list[str] | None = None):
        self.folder, self.ident, self.live, self.lc = Path(folder), ident, [], lc
        self.record = read_record(folder)
        for name in names if names is not None else trackers_of(lc):
            self._guard(name, "open", lambda name=name: self.live.append(
                BACKENDS[name](lc, folder, ident, self.record.get(name, {}))))
        self.record.update({t.name: t.record for t in self.live})
        if self.live:
            write_record(folder, self.record)

    def _guard(self, name: str, what: str, fn, missed: str = "") -> bool:
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - a tracker never costs the run: named in one line, set aside
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            log.warning("tracker %s failed (%s: %s) at %s: it is set aside for the rest of this run%s; %s holds every "
                        "row: python -m ema_pg track import %s sends what it missed", name, type(e).__name__,
                        masked(msg), what, missed, "metrics.csv" if (self.folder / "metrics.csv").exists() else
                        "the folder", self.folder)
            self.live = [t for t in self.live if t.name != name]
            return False

    def each(self, what: str, fn, missed: str = "") -> None:
        for t in list(self.live):
            self._guard(t.name, what, lambda t=t: fn(t), missed)

    def sync(self, rows: list[tuple[int, dict]]) -> dict[str, int]:
        sent = {}
        self.each("sending the record's rows", lambda t: sent.__setitem__(t.name, t.sync(rows)))
        return sent

    def send(self, rows: list[tuple[int, dict]]) -> None:
        if rows:
            self.each(f"iterations {rows[0][0]}-{rows[-1][0]}", lambda t: t.log_rows(rows),
                      missed=f" (from iteration {rows[0][0]})")

    def media(self, step: int, **kw) -> None:
        self.each(f"media of iteration {step}", lambda t: t.media(step, **kw))

    def artifact(self, path: Path, kind: str, name: str, metadata: dict) -> list[str]:
        """Keep ``path`` with each tracker's run; returns the trackers that took it."""
        took = []
        self.each(f"the {kind} {name}", lambda t: (t.artifact(path, kind, name, metadata), took.append(t.name)))
        return took

    def finish(self, status: str, summary: dict | None = None) -> None:
        if summary:
            self.each("the summary", lambda t: t.summary(summary))
        self.each("closing", lambda t: t.finish(status))
        self.live = []


def run_rows(run_dir: Path, upto: int | None = None) -> list[tuple[int, dict]]:
    """What a run folder's trackers must hold: its ``metrics.csv`` rows (to ``upto``) and, once it finished, its
    summary row."""
    rows = csv_rows(run_dir, upto)
    if upto is None and (s := summary_row(run_dir)) is not None:
        rows.append(s)
    return rows


def import_run(run_dir: Path, names: list[str], lc=None) -> dict[str, int]:
    """``track import``: a run folder's record sent to trackers (its config, every metrics row, its summary, its
    plot and eval.json), continuing the tracker runs its ``tracking.json`` names; what they hold is not sent
    again. Returns the rows sent per tracker."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    if lc is not None:
        cfg.logger = OmegaConf.merge(cfg.get("logger") or {}, lc)
    cfg.logger = OmegaConf.merge({"project": "ema-pg", "offline": True, "mlflow_uri": None, "tags": [],
                                  "job_type": "train"}, cfg.get("logger") or {})
    ident = run_identity(cfg, run_dir)
    hub = Trackers(cfg.logger, run_dir, ident, names)
    sent = hub.sync(run_rows(run_dir))
    done = hub.record.setdefault("media_sent", [])
    fresh = [t for t in hub.live if t.media_key not in done]
    if (run_dir / "eval.json").is_file() and fresh:
        plot = run_dir / "curves.png"
        for t in fresh:
            if hub._guard(t.name, "media", lambda t=t: t.media(ident.step, image=plot if plot.is_file() else None,
                                                                 files=(run_dir / "eval.json",))):
                done.append(t.media_key)
    summary = summary_row(run_dir)
    hub.finish("success" if summary else "interrupted", summary[1] if summary else None)
    write_record(run_dir, hub.record)
    return sent


def publish(run_dir: Path, path: Path, kind: str, metadata: dict) -> list[str]:
    """Keep ``path`` (an exported model) with the tracker runs a run folder's ``tracking.json`` names, continuing
    them; the artifact's metadata names the run and its base policy. Returns the trackers that took it ([] where the
    run reported to none)."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    record = read_record(run_dir)
    names = [n for n in BACKENDS if n in record and n != "tensorboard"]  # TensorBoard keeps no artifacts
    if not names or not (run_dir / "config.yaml").is_file():
        return []
    cfg = OmegaConf.load(run_dir / "config.yaml")
    ident = run_identity(cfg, run_dir)
    hub = Trackers(cfg.logger, run_dir, ident, names)
    took = hub.artifact(path, kind, f"{run_dir.name}-{Path(path).name}",
                        {**metadata, "run": str(run_dir.resolve()), "base": ident.params["run.base"],
                         "commit": ident.params["run.commit"]})
    hub.finish("success" if (run_dir / "eval.json").is_file() else "interrupted")
    write_record(run_dir, hub.record)
    return took


# ---------------------------------------------------------------------- a run's hub, as Lightning's logger
def make_loggers(cfg, run_dir: Path, resume_step: int | None):
    """The run's Lightning loggers: the CSV logger (``metrics.csv``, always) and, where the config switches trackers
    on, the hub that feeds them (:class:`ema_pg.engine.tracking.TrackerHub`)."""
    from lightning.pytorch.loggers import CSVLogger

    # the CSV logger starts a fresh file: the intact rows up to the checkpoint's iteration are carried over
    old_rows = metrics_rows(run_dir / "metrics.csv", resume_step) if resume_step is not None else []
    record = None if resume_step is None else [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in old_rows]
    csv = CSVLogger(save_dir=str(run_dir), name="", version="", flush_logs_every_n_steps=10)
    for r in old_rows:  # (the file is rewritten as they go: the trackers are given the rows read here)
        step = r.pop("step")
        csv.log_metrics(r, step=step)
    hub = hub_logger(cfg, run_dir, record)
    return [csv] if hub is None else [csv, hub]


def hub_logger(cfg, run_dir: Path, record: list[tuple[int, dict]] | None):
    """The Lightning logger that feeds a run's trackers (None where the config switches none on); ``record``: a
    continued run's rows up to its checkpoint (None: a new run)."""
    if not trackers_of(cfg.logger):
        return None
    return TrackerHub(cfg, Path(run_dir), record)


def _lightning_logger():
    from lightning.pytorch.loggers.logger import Logger

    return Logger


class TrackerHub(_lightning_logger()):
    """Lightning's view of a run's trackers: rows are held until the checkpoint a resume would take covers them
    (:meth:`flush`, called once the period's checkpoint and its link are written, or a SIGTERM's save), then sent;
    at a resume the rows the trackers lack are sent first. Rank 0 only (Lightning logs from rank 0)."""

    def __init__(self, cfg, run_dir: Path, record: list[tuple[int, dict]] | None):
        super().__init__()
        self.cfg, self.run_dir, self.record = cfg, run_dir, record
        self.pending: list[tuple[int, dict]] = []
        self.pending_samples: list[tuple[int, dict]] = []
        self.trackers: Trackers | None = None
        self.status = "failed"

    @property
    def name(self):
        return "trackers"

    @property
    def version(self):
        return ""

    def start(self) -> None:
        """Open the tracker runs (after the run folder holds its config and model: the identity reads them), and
        send what a continued run's trackers lack of the record up to its checkpoint."""
        ident = run_identity(self.cfg, self.run_dir)
        self.trackers = Trackers(self.cfg.logger, self.run_dir, ident)
        if self.record is not None:
            self.trackers.sync(self.record)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # the identity's params are sent when the tracker run opens

    def log_metrics(self, metrics, step=None) -> None:
        self.pending.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))

    def flush(self) -> None:
        """Send the rows held: a checkpoint now covers them."""
        rows, self.pending = self.pending, []
        media, self.pending_samples = self.pending_samples, []
        if self.trackers is not None:
            self.trackers.send(rows)
            for step, samples in media:
                self.trackers.media(step, samples=samples)
            if self.cfg.logger.get("checkpoints") and rows:  # logger.checkpoints: the checkpoint that covers them
                it = rows[-1][0]
                ckpt = self.run_dir / "checkpoints" / f"iter{it}.ckpt"
                if ckpt.exists():
                    self.trackers.artifact(ckpt.resolve(), "checkpoint", f"{self.run_dir.name}-iter{it}",
                                           {"iteration": it, "run": str(self.run_dir.resolve())})

    def samples(self, step: int, samples: dict) -> None:
        """An evaluation's sample generations, sent with its rows."""
        if samples:
            self.pending_samples.append((step, samples))

    def close(self, status: str, finished: bool = False) -> None:
        """End the tracker runs: a finished run sends its last rows, summary, plot and eval.json first; an
        unfinished one drops the rows no checkpoint covers (its resume runs them again)."""
        if self.trackers is None:
            return
        summary = None
        if finished:
            self.flush()
            s = summary_row(self.run_dir)
            if s is not None:
                step, summary = s
                self.trackers.send([s])
                plot = self.run_dir / "curves.png"
                self.trackers.media(step, image=plot if plot.is_file() else None, files=(self.run_dir / "eval.json",))
                sent = self.trackers.record.setdefault("media_sent", [])
                sent += [t.media_key for t in self.trackers.live if t.media_key not in sent]
        self.pending, self.pending_samples = [], []
        self.trackers.finish(status, summary)
        try:
            write_record(self.run_dir, self.trackers.record)
        except OSError as e:  # closing must not mask what ended the run
            log.warning("%s: not written (%s)", self.run_dir / TRACKING_FILE, e)
        self.trackers = None
