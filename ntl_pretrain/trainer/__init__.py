"""A training run: `trainer.Trainer` composing its jobs, one module each: `startup` (checks, process group,
logging, lock, assets, engine, run folder), `one_step` (one optimizer step), `checkpointing`, `evaluation`
(validation and the evaluation hooks), `fit_loop`; with the start-up checks (`preflight`), the resolved DeepSpeed
config (`ds_config`), the engine build (`engine`), the objective (`training_objective`), the step guard
(`step_guard`) and stop signals (`preemption`)."""
