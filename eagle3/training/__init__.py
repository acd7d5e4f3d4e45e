"""Training an EAGLE-3 draft: `loop` (the Trainer, `run`, `main`) over its parts `schedule`, `feed`, `metrics`,
`run_dir`, `resume` and `kernel_choice`; `train.py` (torchrun's entry point) runs `main`."""
from eagle3.errors import TrainError
from eagle3.training.loop import Trainer, main, run
from eagle3.training.metrics import MetricsLog

__all__ = ["MetricsLog", "TrainError", "Trainer", "main", "run"]
