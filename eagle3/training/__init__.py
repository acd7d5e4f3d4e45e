"""Training an EAGLE-3 draft, in parts (each tested on its own):

- `loop`: `Trainer` (the step, evaluation and the run), `TTTModel` (what DDP wraps), `run`, `main`;
- `schedule`: the learning-rate `Schedule` and the data `Plan`;
- `feed`: this rank's micro-batches to the device (read ahead, prepared, copied on a side stream);
- `metrics`: `MetricsLog` (metrics.jsonl, TensorBoard) and the end-of-run summary;
- `run_dir`: the rules of train.output_dir (its lock, "never", "overwrite", what a stopped run keeps);
- `resume`: which checkpoint a run continues from and what it must share with it;
- `kernel_choice`: debug.kernels and the fp8 head.

The names users and tests import are here: `from eagle3 import training; training.run(cfg)`, and
`train.py` (torchrun's entry point) runs `training.main`.
"""
from eagle3.errors import TrainError
from eagle3.training.kernel_choice import TRITON_HEAD_DIMS, Kernels, select_kernels
from eagle3.training.loop import CAUSES, StepResult, Trainer, TTTModel, Unroll, main, masked_step, run
from eagle3.training.metrics import MetricsLog
from eagle3.training.resume import HEAD_FIXED, RESUME_FIXED, fp8_changes
from eagle3.training.run_dir import OLD_RUN, existing_run, kept, move_old_run, refuse_existing_run
from eagle3.training.schedule import Plan, Schedule

__all__ = ["CAUSES", "HEAD_FIXED", "OLD_RUN", "RESUME_FIXED", "TRITON_HEAD_DIMS", "Kernels", "MetricsLog", "Plan",
           "Schedule", "StepResult", "TTTModel", "TrainError", "Trainer", "Unroll", "existing_run", "fp8_changes",
           "kept", "main", "masked_step", "move_old_run", "refuse_existing_run", "run", "select_kernels"]
