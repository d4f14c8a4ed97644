"""Bad input: one line on stderr naming the problem and the fix, exit status 2, no traceback,
nothing left running. One table: flags, settings files, launcher variables, and the tasks
only the ranks can check (those start real ranks, forked from this process)."""

import importlib.util
import os

import pytest

from ddptrain import free_port
from ddptrain.cli import main
from helpers.commands import alive

TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]",
         "SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "2"}
# (a port of its own: the docs' torch.distributed.launch block uses 29517, and tests run two at a time)
POD = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
       "KUBERNETES_SERVICE_HOST": "10.96.0.1"}  # a Kubeflow PyTorchJob pod
TASKS = "ddptrain_test_tasks:"
INVALID = "invalid_tasks:"  # tasks wrong in one field

# (arguments, environment, words the one line must hold); "{tmp}" is a scratch folder.
CASES = [
    # flags
    (["--batch-size", "0"], {}, "--batch-size must be at least 1"),
    (["--batch-size", "abc"], {}, "--batch-size needs a whole number"),
    (["--max-epochs", "-1"], {}, "--max-epochs must be 0 or more"),
    (["--max-steps", "0"], {}, "--max-steps must be at least 1 (leave it out to train by epochs), got 0"),
    (["--eval-every-steps", "-1"], {}, "--eval-every-steps must be >= 0"),
    (["--nproc", "0"], {}, "--nproc must be at least 1"),
    (["--nproc", "many"], {}, "--nproc must be a number or 'auto'"),
    (["--frobnicate"], {}, "unrecognized arguments: --frobnicate"),
    (["--lr", "-0.1"], {}, "--lr must be a finite number >= 0"),
    (["--lr", "nan"], {}, "--lr must be a finite number >= 0"),
    (["--momentum", "1"], {}, "--momentum must be in [0, 1)"),
    (["--weight-decay", "-1"], {}, "--weight-decay must be a finite number >= 0"),
    (["--timeout", "0"], {}, "--timeout must be a positive number"),
    (["--keep", "0"], {}, "--keep must be at least 1"),
    (["--save-every", "-1"], {}, "--save-every must be >= 0"),
    (["--save-seconds", "-1"], {}, "--save-seconds must be a number >= 0"),
    (["--mttf-hours", "-1"], {}, "--mttf-hours must be a number of hours >= 0"),
    (["--mttf-hours", "2", "--save-seconds", "0"], {}, "--mttf-hours times snapshots from the first one's cost"),
    (["--max-restarts", "-1"], {}, "--max-restarts must be >= 0"),
    (["--workers", "-1"], {}, "--workers must be >= 0"),
    (["--warmup-steps", "-1"], {}, "--warmup-steps must be >= 0"),
    (["--eval-every", "-1"], {}, "--eval-every must be >= 0"),
    (["--grad-accum", "0"], {}, "--grad-accum must be at least 1"),
    (["--skip-nonfinite", "-1"], {}, "--skip-nonfinite must be >= 0"),
    (["--clip-grad", "0"], {}, "--clip-grad must be a finite number > 0"),
    (["--bucket-cap-mb", "0"], {}, "--bucket-cap-mb must be a finite number > 0"),
    (["--device", "tpu"], {}, "invalid choice: 'tpu'"),
    (["--device", "cuda"], {}, "no CUDA GPU is visible"),
    (["--backend", "nccl", "--device", "cpu"], {}, "--backend nccl needs CUDA"),
    (["--comm-hook", "bf16", "--device", "cpu"], {}, "--comm-hook bf16 needs the nccl backend"),
    (["--strategy", "zero"], {}, "invalid choice: 'zero'"),
    # flags that would do nothing
    (["--early-stop-delta", "0.01"], {}, "--early-stop-delta belongs to --early-stop N"),
    (["--ema-every", "4"], {}, "--ema-every belongs to --ema DECAY"),
    (["--init-from-partial"], {}, "--init-from-partial belongs to --init-from PATH"),
    (["--keep-best", "eval_loss", "--early-stop", "2", "--eval-every", "0"], {},
     "--early-stop 2 needs evaluations during the run, but --eval-every 0 evaluates only at the end"),
    (["--strategy", "fsdp", "--comm-hook", "fp16"], {}, "--comm-hook is a DDP option"),
    (["--strategy", "fsdp", "--static-graph"], {}, "--static-graph is a DDP option"),
    (["--strategy", "fsdp", "--bucket-cap-mb", "5"], {}, "--bucket-cap-mb is a DDP option"),
    (["--strategy", "fsdp", "--find-unused-parameters"], {}, "--find-unused-parameters is a DDP option"),
    (["--strategy", "hsdp", "--static-graph"], {}, "--static-graph is a DDP option and does nothing with --strategy h"),
    (["--replicas", "2"], {}, "--replicas is the number of replica groups of --strategy hsdp"),
    (["--strategy", "hsdp", "--replicas", "0"], {}, "--replicas must be at least 1, got 0"),
    (["--sync", "diloco", "--sync-every", "0"], {}, "--sync-every must be at least 1 (optimizer steps between syncs), "
     "got 0"),
    (["--sync-every", "4"], {}, "--sync-every belongs to --sync local-sgd or diloco"),
    (["--sync", "local-sgd", "--outer-lr", "0.5"], {}, "--outer-lr belongs to --sync diloco (this run's --sync is "
     "local-sgd)"),
    (["--outer-momentum", "0.5"], {}, "--outer-momentum belongs to --sync diloco"),
    (["--sync", "diloco", "--outer-lr", "0"], {}, "--outer-lr must be a finite number > 0"),
    (["--sync", "diloco", "--outer-momentum", "1"], {}, "--outer-momentum must be in [0, 1)"),
    (["--sync", "diloco", "--strategy", "fsdp"], {}, "--sync diloco trains DDP inside each replica group, without "
     "--strategy fsdp for now"),
    (["--sync", "local-sgd", "--ema", "0.9"], {}, "without --ema for now"),
    (["--sync", "diloco", "--outer-lr", "1", "--outer-momentum", "0.5", "--nproc", "2"], {},
     "--sync diloco needs 2 or more replica groups, and this job has one"),
    (["--sync", "diloco", "--replicas", "2", "--outer-lr", "1"], {},
     "--sync diloco needs --outer-momentum: no outer step held on every job measured"),
    (["--sync", "diloco", "--replicas", "2"], {}, "--sync diloco needs --outer-lr and --outer-momentum: no outer step"),
    (["--sync", "local-sgd", "--nproc", "2", "--replicas", "3"], {}, "--replicas 3 does not divide the 2 ranks"),
    (["--sync", "diloco", "--fault-tolerance", "torchft", "--replica-groups", "2", "--replicas", "2"], {},
     "--replicas splits one job's ranks into groups; under --fault-tolerance torchft each replica group is a job"),
    (["--sync", "local-sgd", "--fault-tolerance", "torchft"], {}, "--sync local-sgd needs 2 or more replica groups "
     "to sync; give --replica-groups N"),
    (["--task", "nosuchtask"], {}, "unknown task"),
    (["--task", ":"], {}, "not MODULE:FUNC"),
    (["--task", TASKS + "nope"], {}, "has no function 'nope'"),
    (["--task", "no_such_module_xyz:f"], {}, "cannot import 'no_such_module_xyz'"),
    (["--resume", "/no/such/snapshot.pt"], {}, "no such snapshot"),
    (["--resume", "{tmp}/notes.txt"], {}, "cannot be read"),
    (["--run-dir", "/proc/x/run"], {}, "--run-dir /proc/x/run cannot be created"),
    (["--run-dir", "{tmp}/notes.txt/run"], {}, "notes.txt is a file, not a folder"),
    (["--config", "{tmp}/none.toml"], {}, "cannot read it"),
    (["--config", "{tmp}/unknown.toml"], {}, "'bogus' is not a ddptrain setting"),
    (["--config", "{tmp}/wrong.toml"], {}, "'max-epochs' needs a whole number"),
    (["--config", "{tmp}/notes.txt"], {}, "not valid TOML"),
    # launcher variables
    ([], {**TORCHRUN, "RANK": "5"}, "RANK=5 is outside the world (WORLD_SIZE=2)"),
    ([], {**TORCHRUN, "RANK": "one"}, "RANK='one' is not a whole number"),
    ([], {**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE=0: the world needs at least one rank"),
    ([], {**TORCHRUN, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is outside this node's 2"),
    ([], {**TORCHRUN, "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a port"),
    ([], {**TORCHRUN, "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR='no-such-host.invalid' is not a known"),
    ([], {"RANK": "1"}, "RANK is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    ([], {"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a port (0-65535)"),
    ([], {"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a whole number"),
    ([], {"MASTER_ADDR": "no-such-host.invalid"}, "is not a known host"),
    ([], {**POD, "RANK": "2"}, "RANK=2 is outside the PyTorchJob's 2 pod(s) (WORLD_SIZE)"),
    (["--timeout", "3"], POD, "not every pod of the PyTorchJob joined within --timeout 3 s at 127.0.0.1:"),
    ([], {**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not a whole number"),
    ([], {**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is outside the world (SLURM_STEP_NUM_TASKS=2)"),
    ([], {**SLURM, "SLURM_JOB_NODELIST": "node[1-"}, "SLURM_JOB_NODELIST='node[1-' is not a Slurm host list"),
    ([], {**SLURM, "SLURM_TASKS_PER_NODE": "two"}, "cannot read Slurm tasks per node"),
    # what only the ranks can know (real ranks start, and stop before any training step)
    (["--batch-size", "2000"], {}, "--batch-size 2000 is larger than a rank's share of the data "
                                   "(2048 samples / 2 ranks = 1024); use --batch-size 1024 or less"),
    (["--task", INVALID + "not_a_task"], {}, "the factory returned str, not a ddptrain.Task"),
    (["--task", INVALID + "both_loss_and_step"], {}, "Task has both loss_fn and step_fn"),
    (["--task", INVALID + "neither_loss_nor_step"], {}, "Task has neither loss_fn nor step_fn"),
    (["--task", INVALID + "non_scalar_step"], {}, "Task.step_fn returned a tensor of shape (32, 1) and dtype float32"),
    (["--task", INVALID + "integer_step"], {},
     "Task.step_fn returned a tensor of shape () and dtype int64, not a scalar floating-point loss"),
    (["--task", INVALID + "detached_step"], {}, "Task.step_fn returned a loss that does not depend on any trainable"),
    (["--task", TASKS + "failing_stream"], {}, "the training set's iterator failed before its first batch: "
                                               "FileNotFoundError: shard-00000.jsonl is missing"),
    (["--task", TASKS + "empty_stream", "--max-steps", "5"], {},
     "the training stream gave no sample in epoch 0, on any rank"),
    (["--task", TASKS + "failing_stream", "--workers", "2"], {}, "the training set's iterator failed before its "
                                                                 "first batch: FileNotFoundError: shard-00000.jsonl"),
    (["--task", TASKS + "stream", "--lr-schedule", "cosine"], {},
     "--lr-schedule cosine needs the run's length, and an iterable training set's epoch has no known length"),
    (["--task", INVALID + "empty_eval_set"], {}, "Task.eval_set is empty; give it samples, or leave it None"),
    (["--task", TASKS + "unused_parameters"], {}, "parameter(s) unused.weight, unused.bias got no gradient in the "
                                                  "first step; use them in the loss"),
    (["--sync-batchnorm"], {}, "--sync-batchnorm needs CUDA GPUs"),
    (["--task", "digits", "--keep-best", "eval_f1"], {},
     "--keep-best eval_f1: the evaluation has no such figure; it has eval_accuracy, eval_loss"),
    (["--config", "{tmp}/twice.toml"], {}, "'max_epochs' and 'max-epochs' are the same setting"),
    (["--task", INVALID + "eval_without_samples"], {}, "Task.eval_fn must return a dict of per-batch sums with"),
    (["--strategy", "fsdp", "--activation-checkpointing"], {}, "--activation-checkpointing needs blocks"),
    (["--run-dir", "{tmp}/broken"], {}, "no usable snapshot in"),
]


@pytest.mark.parametrize("args,env,words", CASES, ids=[" ".join(c[0]) or " ".join(c[1]) for c in CASES])
def test_bad_input_is_one_line_exit_2(args, env, words, tmp_path, capfd, monkeypatch):
    (tmp_path / "notes.txt").write_text("not a snapshot = [")
    (tmp_path / "unknown.toml").write_text("bogus = 1\n")
    (tmp_path / "wrong.toml").write_text('max-epochs = "five"\n')
    (tmp_path / "twice.toml").write_text("max_epochs = 2\nmax-epochs = 3\n")
    (tmp_path / "broken" / "snapshots").mkdir(parents=True)
    (tmp_path / "broken" / "snapshots" / "step-000000003.pt").write_bytes(b"\x00" * 10)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_")) or k in TORCHRUN or k in POD]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--run-dir" not in args:
        args += ["--run-dir", str(tmp_path / "run")]
    try:
        code = main(["train", "--nproc", "2", "--max-epochs", "1", *args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capfd.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert words in err and "Traceback" not in err, err
    for pid_file in (tmp_path / "run" / "pids").glob("*.pid"):
        assert not alive(int(pid_file.read_text())), "a rank outlived the error"


def test_busy_master_port_is_one_line(monkeypatch, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        assert main(["train", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "Address already in use" in err and "unset MASTER_PORT" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("url,words", [
    ("s3://", "--run-dir s3://: no bucket; write s3://BUCKET/PREFIX"),
    ("s3:///prefix", "--run-dir s3:///prefix: no bucket; write s3://BUCKET/PREFIX"),
    ("ftp://host/run", "--run-dir ftp://host/run: unknown storage scheme 'ftp'; use a local folder or one of s3://"),
    ("gs://bucket/run", "--run-dir gs://bucket/run: needs the gcsfs package; pip install 'ddptrain[gcs]'"),
    ("az://container/run", "--run-dir az://container/run: needs the adlfs package; pip install 'ddptrain[azure]'"),
])
def test_a_run_dir_url_that_cannot_work_is_one_line_at_once_and_writes_nothing(url, words, tmp_path):
    """The real command: no store client is imported and nothing is asked of the network (the
    gs:// case used to take 9.5 s and point at AWS_ENDPOINT_URL). Measured here: ~0.3 s each,
    as long as a plain bad flag's error; on a busy machine both once took 5 s, so the bound is
    the plain error's time, measured just before, plus 4 s (a network wait took 9.5 s)."""
    import time

    from helpers.commands import clean_env, ddptrain_cli

    if url.startswith("gs://") and importlib.util.find_spec("gcsfs") or \
            url.startswith("az://") and importlib.util.find_spec("adlfs"):
        pytest.skip("its fsspec backend is installed here, so there is no error to see")
    env = clean_env(DDPTRAIN_CACHE=str(tmp_path / "cache"))
    took = []
    for args in (["--batch-size", "0"], ["--run-dir", url]):
        started = time.monotonic()
        result = ddptrain_cli("train", *args, env=env, fresh=True)
        took.append(time.monotonic() - started)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"ddptrain: error: {words}"), result.stderr
    assert took[1] < took[0] + 4, f"{took[1]:.1f} s, a plain bad flag {took[0]:.1f} s"
    assert not (tmp_path / "cache").exists()  # no mirror made
