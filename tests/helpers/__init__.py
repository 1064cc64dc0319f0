"""The tests' shared helpers, one home for each (import the submodule you need):

- `helpers.distributed`: `free_port()` (every test that starts DeepSpeed or a service takes its port here) and
  `run_workers()` (a `tests/workers/` script once per rank, with a timeout that turns a hang into a failure);
- `helpers.launch`: the environment of a launched run, configs/demo.yaml made small (`demo_overrides`), the
  `deepspeed ... launch/pretrain.sh` command and a subprocess runner with a timeout, `--dry-run`;
- `helpers.tensorboard`: scalars read back from a run's event files with TensorBoard's own reader;
- `helpers.models`: tiny Llama models and the tokenizer stand-ins (word-level, byte-level BPE, one per character);
- `helpers.numeric`: relative error of a tensor (norm-wise);
- `helpers.documents`: packed rows of 3 documents and the plain model's results on each document alone;
- `helpers.multinode`: timed launcher runs and the clean-up of the multi-node tests (ssh, Slurm);
- `helpers.sync_counter`: counts the calls that force a device-to-host sync.
"""
