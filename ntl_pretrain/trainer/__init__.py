"""A training run: `trainer.Trainer` owning its typed parts, state, record and step hooks (`parts`) and running the
fit loop, with its jobs one module each: `startup` (checks, process group, logging, lock, assets, engine, run
folder; builds the parts), `one_step` (one optimizer step), `checkpointing`, `evaluation` (validation and the
evaluation hooks); with the start-up checks (`preflight`), the resolved DeepSpeed config (`ds_config`), the engine
build (`engine`), the objective and logged figures (`training_objective`), the step guard (`step_guard`) and stop
signals (`preemption`)."""
