"""A training run: `trainer.Trainer`, with the start-up checks (`preflight`), the resolved DeepSpeed config
(`ds_config`), the engine build (`engine`), the objective (`training_objective`), the step guard (`step_guard`) and
stop signals (`preemption`)."""
