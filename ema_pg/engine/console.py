"""The console of a run: third-party lines that tell our user nothing are silenced where they come from, one by
one (each filter names the message it drops; nothing else is hidden), and a progress bar counts RL iterations.

Silenced: Lightning's hardware lines ("GPU available ...", the run's start-up line says what runs), its
mixed-precision line ("Using bfloat16 Automatic Mixed Precision", the start-up line names the precision) and its
litlogger tip; its "modules in eval mode" warning (the policy is kept in eval mode on purpose: no dropout in RL);
its own deprecated ``LeafSpec`` use; its "checkpoint directory exists" and "logs directory exists" warnings on a
resume (the folder is the run's own), and its "dirpath has changed" on a stage (``init_from``: a new folder by
design); the loaders' "weights_only" notice (checkpoints are the run's own files);
transformers' weight loading and saving bars (seconds-long on the models a run builds); DeepSpeed's accelerator
guess on a machine without CUDA (it is told ``DS_ACCELERATOR=cpu``, the answer its guess would give), the
deprecation of the two torch.distributed collectives DeepSpeed calls (DeepSpeed's to change, not the user's), and
the compiler command lines of DeepSpeed's build checks (distutils logs them on the root logger, which the run's
log shows at INFO).

This module imports no third-party package: every command calls :func:`quiet_third_party`, and a report, a claims
ledger or a study's coordinator that imported Lightning (and so torchmetrics, SciPy and transformers) to silence it
paid seconds at each start for lines it never prints. The run's progress bar lives with the trainer
(:class:`ema_pg.engine.fit.IterationBar`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

#: the messages of third-party warnings a run drops (regular expressions matched at the message's start)
QUIET_WARNINGS = (
    r".*module\(s\) in eval mode at the start of training",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Checkpoint directory .* exists and is not empty",
    r"Experiment logs directory .* exists and is not empty",
    r"`weights_only` was not set",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"The dirpath has changed from",
)
#: the start of Lightning's info lines a run drops
QUIET_LIGHTNING = ("GPU available:", "TPU available:", "HPU available:", "💡 Tip", "You are using a CUDA device",
                   "Using bfloat16 Automatic Mixed Precision", "Using 16bit Automatic Mixed Precision")


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(QUIET_LIGHTNING)


class _DropDistutils(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "distutils" not in record.pathname


def quiet_third_party() -> None:
    """Install the filters above, and the masking of secrets in log lines (idempotent)."""
    mask_logged_secrets()
    installed = {f[1].pattern for f in warnings.filters if f[0] == "ignore" and f[1] is not None}
    for message in QUIET_WARNINGS:
        if message not in installed:
            warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.accelerators.cuda"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in lg.filters):
            lg.addFilter(_DropLines())
    root = logging.getLogger()
    if not any(isinstance(f, _DropDistutils) for f in root.filters):
        root.addFilter(_DropDistutils())
    # transformers' bars: a process that has not imported it yet reads the switch when it does (through
    # huggingface_hub, which reads it at its own import); one that has is told now
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()
    if "DS_ACCELERATOR" not in os.environ and "torch" in sys.modules:  # DeepSpeed runs where torch does
        if not sys.modules["torch"].cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def _masking_factory(base):
    """A log-record factory over ``base`` that masks every URL's password in the record's message and in the text
    of its exception (formatted now, once, masked), whichever library logs it and whichever handler prints it."""

    def make(*args, **kwargs):
        record = base(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose args do not fit its message: logging reports it itself
            return record
        if masked(text) != text:
            record.msg, record.args = masked(text), None
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            record.exc_text = masked(logging.Formatter().formatException(record.exc_info))
        return record

    make.masks_secrets = True
    return make


def mask_logged_secrets() -> None:
    """Every log record from now on has its URLs' passwords masked (idempotent): a study's storage URL or a
    tracking URI in a third-party line (Optuna's, SQLAlchemy's) is never printed or written with its password."""
    if not getattr(logging.getLogRecordFactory(), "masks_secrets", False):
        logging.setLogRecordFactory(_masking_factory(logging.getLogRecordFactory()))


def log_file_only(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """A line for the run's log file alone (the root logger's file handlers, Hydra's ``train.log``): a command that
    ends on the same line prints it once, as its last, instead of once by the log and once by its exit."""
    record = logger.makeRecord(logger.name, level, "(command)", 0, msg, args, None)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler) and record.levelno >= h.level:
            h.handle(record)


_SECRET_IN_URL = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)([^@\s/]+)(@)")


def masked(text: str | None) -> str | None:
    """``text`` with every URL's password replaced by ``***`` (``postgresql://user:***@host/db``): what a line or a
    file may show of a storage or tracking URL."""
    return text if not text else _SECRET_IN_URL.sub(r"\1***\3", text)
