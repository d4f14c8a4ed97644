"""The experiment trackers ``--tracker`` names: csv, tensorboard, mlflow, wandb.

Each is a ``tracking.Tracker``: the tracking thread opens its run, sends metrics and closes it
with the run's files attached. Their packages are imported there, on rank 0, never by the
training loop. ``check_installed`` runs before any rank starts, so a missing package is the
command's one-line error naming the extra to install.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..console import say
from ..errors import ConfigError
from .tracking import Tracker

# tracker -> (the package it imports, the extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}


def check_installed(names: list[str]) -> None:
    """ConfigError naming the extra when a tracker's package is not installed."""
    for name in names:
        package, extra = PACKAGES.get(name, (None, None))
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--tracker {name}: the {package} package is not installed; "
                              f"pip install 'ddptrain[{extra}]'")


# MLFLOW_TRACKING_URI schemes MLflow's client has stores for (besides http(s) servers and folders).
MLFLOW_STORES = ("sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


def check_settings(names: list[str]) -> None:
    """Before any rank starts: a tracker's address that cannot work is one line, not a run that
    trains untracked (MLflow's client only says so in the tracking thread, as a warning)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in names and uri:
        problem = mlflow_uri_problem(uri)
        if problem:
            raise ConfigError(f"MLFLOW_TRACKING_URI={uri!r}: {problem}; use http://HOST:PORT for a server, "
                              "a folder, or sqlite:///PATH")


def mlflow_uri_problem(uri: str) -> str | None:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as error:
        return f"cannot be parsed ({error})"
    scheme = parts.scheme.split("+", 1)[0]  # postgresql+psycopg2://
    if scheme in ("http", "https"):
        return None if parts.hostname else "no host"
    if scheme in ("", "file") or scheme in MLFLOW_STORES or len(scheme) == 1:  # C:\ on Windows
        return None
    return f"unknown scheme {parts.scheme!r}"


def make_trackers(names: list[str]) -> list[Tracker]:
    """The trackers named (ObservationSettings.trackers())."""
    return [KINDS[name]() for name in names]


def tracker_named(name: str) -> Tracker:
    """One tracker by name (``ddptrain report --sync NAME``)."""
    if name not in KINDS:
        raise ConfigError(f"--sync {name}: unknown tracker; choose one of {', '.join(KINDS)}")
    check_installed([name])
    return KINDS[name]()


class CsvTracker(Tracker):
    """``RUN_DIR/metrics.csv``: a row per step, a column per metric (the file is written again
    when a new metric appears, so every row has every column)."""

    name, tells_held = "csv", True

    def open(self, run_dir: Path, params: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
        self.path = run_dir / "metrics.csv"
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        if self.path.is_file():
            with open(self.path, newline="") as handle:
                reader = csv.DictReader(handle)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)
        return {"id": "metrics.csv"}

    def held(self) -> set[tuple[str, int]]:
        return {(key, int(row["step"])) for row in self.rows for key, value in row.items()
                if key != "step" and value not in ("", None)}

    def send(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        row = {"step": step, **metrics}
        joined = bool(self.rows) and int(self.rows[-1]["step"]) == step  # one row per step (the run's goodput
        if joined:                                                   # shares the last epoch's)
            self.rows[-1].update(metrics)
        else:
            self.rows.append(row)
        new = [key for key in metrics if key not in self.columns]
        if new or joined or not self.path.is_file():
            self.columns += new
            tmp = self.path.with_name(f".metrics.csv.{os.getpid()}.tmp")
            with open(tmp, "w", newline="") as handle:
                writer = csv.DictWriter(handle, self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
            os.replace(tmp, self.path)
        else:
            with open(self.path, "a", newline="") as handle:
                csv.DictWriter(handle, self.columns).writerow(row)


class TensorBoardTracker(Tracker):
    """``RUN_DIR/tensorboard/``: every metric as a scalar at its step."""

    name = "tensorboard"

    def open(self, run_dir: Path, params: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        return {"id": "tensorboard"}

    def send(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step, walltime=wall_time)
        self.writer.flush()

    def close(self, status: str, artifacts: list[Path], summary: dict[str, Any]) -> None:
        self.writer.close()


def _http_patience() -> None:
    """MLflow's client retries a request 7 times with growing pauses (minutes against a server
    that is down); one retry after a short pause is enough here: what a tracker misses,
    ``report --sync`` sends later. The user's own settings win."""
    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")):
        os.environ.setdefault(name, value)


MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class MlflowTracker(Tracker):
    """An MLflow run (``MLFLOW_TRACKING_URI``: a server, or ``sqlite:///PATH``; ``MLFLOW_EXPERIMENT_NAME``,
    default ``ddptrain``). Resumed runs continue it; the server says which steps it holds."""

    name, tells_held = "mlflow", True

    def open(self, run_dir: Path, params: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
        _http_patience()
        import mlflow
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or saved.get("tracking_uri") or mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self._experiment_id()
        run = self._existing(saved.get("id")) or self._started_as(experiment, saved["uid"])
        if run is None:
            tags = {"ddptrain.run_dir": str(run_dir.resolve()), "ddptrain.uid": saved["uid"]}
            run = self.client.create_run(experiment, run_name=run_dir.name, tags=tags)
            say(f"mlflow: run {run.info.run_id} in experiment {run.info.experiment_id} at {uri}")
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        # parameters cannot change in MLflow: a resumed run keeps the first values (config.json has the rest)
        fresh = [Param(key, value[:6000]) for key, value in params.items() if key not in run.data.params]
        for start in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[start:start + 100])
        return {"id": self.run_id, "tracking_uri": uri}

    def _existing(self, run_id: str | None) -> Any:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return run if run.info.lifecycle_stage == "active" else None

    def _started_as(self, experiment: str, uid: str) -> Any:
        """The run an earlier attempt started under ``uid`` (killed before it kept the run's id)."""
        found = self.client.search_runs([experiment], filter_string=f"tags.`ddptrain.uid` = '{uid}'", max_results=1)
        return found[0] if found else None

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddptrain"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another job created it a moment ago
            return self.client.get_experiment_by_name(name).experiment_id  # type: ignore[union-attr]  # it exists now

    def held(self) -> set[tuple[str, int]]:
        keys = self.client.get_run(self.run_id).data.metrics
        return {(key, m.step) for key in keys for m in self.client.get_metric_history(self.run_id, key)}

    def send(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        import time

        from mlflow.entities import Metric

        stamp = int((wall_time or time.time()) * 1000)
        values = [Metric(key, value, stamp, step) for key, value in metrics.items()]
        for start in range(0, len(values), 1000):
            self.client.log_batch(self.run_id, metrics=values[start:start + 1000])

    def close(self, status: str, artifacts: list[Path], summary: dict[str, Any]) -> None:
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        if summary:
            self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.update_run(self.run_id, status=MLFLOW_STATUS[status])


class WandbTracker(Tracker):
    """A Weights & Biases run (its own variables: ``WANDB_PROJECT``, default ``ddptrain``;
    ``WANDB_MODE=offline`` keeps it in ``RUN_DIR/wandb/`` for ``wandb sync``). Resumed runs
    continue it (``resume="allow"`` with the kept id)."""

    name = "wandb"

    def open(self, run_dir: Path, params: dict[str, str], saved: dict[str, Any]) -> dict[str, Any]:
        import wandb

        self.run_dir = run_dir
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ddptrain"), dir=str(run_dir),
                              id=saved.get("id") or saved["uid"], resume="allow", name=run_dir.name,
                              settings=wandb.Settings(console="off", silent=True))
        self.run.config.update(params, allow_val_change=True)
        # Offline, what the run holds is in its files (each attempt writes its own), read back
        # with wandb's reader: a killed attempt's file lacks what wandb had not written yet.
        self.tells_held = bool(getattr(self.run.settings, "_offline", False)) and wandb_reader() is not None
        return {"id": self.run.id}

    def held(self) -> set[tuple[str, int]]:
        if not self.tells_held:
            return set()
        pairs: set[tuple[str, int]] = set()
        for path in self.run_dir.glob(f"wandb/offline-run-*-{self.run.id}/run-{self.run.id}.wandb"):
            for row in wandb_history(path):
                step = row.pop("_step", None)
                pairs.update((key, int(step)) for key in row if step is not None and not key.startswith("_"))
        return pairs

    def send(self, step: int, metrics: dict[str, float], wall_time: float | None) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str, artifacts: list[Path], summary: dict[str, Any]) -> None:
        for path in artifacts:  # files in the run's folder are uploaded when it finishes
            shutil.copy(path, Path(self.run.dir) / path.name)
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if status == "finished" else 1)


def wandb_reader() -> tuple[Any, Any] | None:
    """wandb's own reader of its run files and their record type; None where this wandb has none
    (0.29 and later ship no Python reader)."""
    try:
        from wandb.proto import wandb_internal_pb2
        from wandb.sdk.internal import datastore
    except ImportError:
        return None
    return datastore, wandb_internal_pb2


def wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history rows of one W&B run file (``{key: value, "_step": step}``), up to where a
    killed writer left it."""
    reader = wandb_reader()
    if reader is None:
        return []
    datastore, records = reader
    rows = []
    store = datastore.DataStore()
    try:
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = records.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    except Exception:  # noqa: BLE001 - a file cut short by a kill: what came before it counts
        pass
    return rows


KINDS: dict[str, type[Tracker]] = {"csv": CsvTracker, "tensorboard": TensorBoardTracker, "mlflow": MlflowTracker,
                                   "wandb": WandbTracker}
